"""``--restart on-failure``: whether a runtime that ended by itself is started again, after how long, and when
the front end gives up. Headless and the app share it.

A crash is an end nobody asked for that a restart may cure: killed by a signal (not our own stop), or an exit
code other than 0 (stopped), 2 (bad usage or config) and 3 (refused by the swarm), which a restart would only
repeat. The runtime starts again with the same command, hence the same token, config dir and identity key.
The n-th crash within RESTART_WINDOW_S waits RESTART_BASE_S * 2**(n-1) seconds, at most RESTART_CAP_S; the
RESTART_LIMIT-th gives up. A stop the front end asked for (q, Ctrl-C, SIGTERM) is never a crash.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal

from agora_client.events import ErrorEvent, ExitEvent
from agora_client.frontend.exit_codes import EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from agora_client.frontend.stream import EventLine, StderrLine, StreamItem

RestartMode = Literal["never", "on-failure"]
RESTART_MODES: tuple[RestartMode, ...] = ("never", "on-failure")
RESTART_BASE_S = 5.0
RESTART_CAP_S = 60.0
RESTART_LIMIT = 6  # crashes within the window that make the front end give up
RESTART_WINDOW_S = 30 * 60.0
_FINAL_CODES = (EXIT_OK, EXIT_USAGE, EXIT_REJECTED)  # ends a restart would only repeat


def is_crash(code: int | None) -> bool:
    """A runtime end a restart may cure (code None: it could not even be started, which a restart repeats)."""
    return code is not None and code not in _FINAL_CODES


def describe_end(code: int | None) -> str:
    """How a runtime ended, in words: "killed by SIGKILL", "exit code 1"."""
    if code is None:
        return "could not start"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def restart_help() -> str:
    """The --restart flag's help: the rule, with its numbers."""
    return (
        f"on-failure: start a crashed runtime again (killed, or exited with an error other than bad config or a "
        f"refusal) with the same identity, after {RESTART_BASE_S:.0f}s, then twice as long each time, at most "
        f"{RESTART_CAP_S:.0f}s; give up after {RESTART_LIMIT} crashes within {RESTART_WINDOW_S / 60:.0f} minutes. "
        "q, Ctrl-C and SIGTERM never restart (default: never)"
    )


@dataclass(frozen=True)
class RestartDecision:
    """What to do after a crash: start again after ``delay_s`` seconds, or give up (``delay_s`` None)."""

    delay_s: float | None
    crashes: int  # within the window, this one included
    text: str  # the line that says why and what comes next

    @property
    def gives_up(self) -> bool:
        return self.delay_s is None


def next_step(decision: RestartDecision | None) -> str:
    """What follows a runtime's end, in words for a notification ("" when nothing does)."""
    if decision is None:
        return ""
    return "giving up" if decision.gives_up else f"starting again in {decision.delay_s:g}s"


class RestartPolicy:
    """Counts crashes within a sliding window and answers each with a delay, or with giving up."""

    def __init__(
        self,
        mode: RestartMode = "never",
        *,
        limit: int = RESTART_LIMIT,
        window_s: float = RESTART_WINDOW_S,
        base_s: float = RESTART_BASE_S,
        cap_s: float = RESTART_CAP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in RESTART_MODES:
            raise ValueError(f"restart mode {mode!r} is not one of {', '.join(RESTART_MODES)}")
        self.mode, self.limit, self.window_s, self.base_s, self.cap_s = mode, limit, window_s, base_s, cap_s
        self._clock = clock
        self._crashes: deque[float] = deque()

    def after_end(self, code: int | None, reason: str) -> RestartDecision | None:
        """The decision for a runtime that ended by itself with ``code``; None when it is not restarted at all."""
        if self.mode == "never" or not is_crash(code):
            return None
        now = self._clock()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.window_s:
            self._crashes.popleft()
        crashes = len(self._crashes)
        if crashes >= self.limit:
            text = (
                f"The worker runtime crashed {crashes} times within {self.window_s / 60:g} minutes; not starting "
                f"it again. Last error: {reason}"
            )
            return RestartDecision(None, crashes, text)
        delay = min(self.cap_s, self.base_s * 2 ** (crashes - 1))
        text = (
            f"The worker runtime crashed ({reason}); starting it again with the same identity in {delay:g}s "
            f"(crash {crashes}; giving up at {self.limit} within {self.window_s / 60:g} minutes)"
        )
        return RestartDecision(delay, crashes, text)


class LastWords:
    """Why a runtime ended, from its own output.

    Its error event, else its exit event's reason, else its last stderr line."""

    def __init__(self) -> None:
        self.error = self.exit_reason = self.stderr = ""

    def observe(self, item: StreamItem) -> None:
        if isinstance(item, StderrLine):
            self.stderr = item.text
        elif isinstance(item, EventLine) and isinstance(item.event, ErrorEvent):
            self.error = item.event.message
        elif isinstance(item, EventLine) and isinstance(item.event, ExitEvent) and item.event.code != 0:
            self.exit_reason = item.event.reason

    def reason(self, code: int | None) -> str:
        """``describe_end(code)``, with what the runtime said last: "exit code 1: CUDA out of memory"."""
        said = self.error or self.exit_reason or self.stderr
        return f"{describe_end(code)}: {said}" if said else describe_end(code)
