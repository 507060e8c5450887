"""``--notify-cmd CMD``: a command run with a short message when something happens that an owner away from the
screen wants to hear of. Headless and the app share it.

What calls for one (its kind, in ``$AGORA_NOTIFY_KIND``): the runtime dropped out (``dropped``: it ended and
nobody asked it to), the swarm refused it (``refused``) or banned it (``banned``), it ran out of memory
(``out_of_memory``), or it left the queue for Active (``active``). Each kind is said once per occurrence: once
per run of the runtime (a restarted runtime may be refused or reach Active again), and one ``dropped`` per end.

No shell runs: CMD is split as a shell would split it (``shlex``) and run directly, with the message as its last
argument and in ``$AGORA_NOTIFY_MESSAGE``, e.g. ``--notify-cmd "curl -s https://ntfy.sh/my-topic -d"``. The
message is redacted (the token and anything that looks like a secret) and the command's environment has no
HF_TOKEN. It runs in the background: a command that fails or takes longer than NOTIFY_TIMEOUT_S (then it is
killed) costs one warning line, never the runtime.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from agora_client.events import AuthEvent, ErrorEvent, Event, LogEvent, StageEvent, SyncEvent
from agora_client.frontend.restart import describe_end
from agora_client.system.redact import redact_text

NotifyKind = Literal["dropped", "refused", "banned", "out_of_memory", "active"]
NOTIFY_TIMEOUT_S = 10.0
CLOSE_GRACE_S = 5.0  # at exit: how long a notification still running may finish (the last one says why we stopped)
MESSAGE_LIMIT = 240
_OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError|\bOOM\b", re.IGNORECASE)
_BANNED = re.compile(r"\bbann(?:ed|ing)\b|\bban\b", re.IGNORECASE)  # the runtime has no ban event: its words say it
_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@dataclass(frozen=True)
class Alert:
    kind: NotifyKind
    message: str


class Alerts:
    """Which alerts a runtime's stream calls for, each kind once per run."""

    def __init__(self, host: str | None = None) -> None:
        self._prefix = f"Agora ({host or socket.gethostname()})"
        self._said: set[NotifyKind] = set()
        self._stage = ""

    def new_run(self) -> None:
        """A (re)started runtime: every kind may be said again."""
        self._said.clear()

    def on_event(self, event: Event) -> list[Alert]:
        if isinstance(event, (AuthEvent, StageEvent)) and event.stage:
            self._stage = event.stage
        if isinstance(event, AuthEvent) and event.status == "rejected":
            kind: NotifyKind = "banned" if _BANNED.search(event.message) else "refused"
            return self._say(
                kind, f"the swarm {'banned' if kind == 'banned' else 'refused'} this worker: {event.message}"
            )
        if isinstance(event, ErrorEvent) or (isinstance(event, LogEvent) and event.level == "error"):
            if _OUT_OF_MEMORY.search(event.message):
                return self._say("out_of_memory", f"the worker ran out of memory: {event.message}")
            if _BANNED.search(event.message):
                return self._say("banned", f"this worker was banned: {event.message}")
        if isinstance(event, SyncEvent) and event.phase == "active":
            stage = f" on stage {self._stage}" if self._stage else ""
            return self._say("active", f"the worker left the queue and is Active{stage}")
        return []

    def on_end(self, code: int | None, reason: str, next_step: str = "") -> list[Alert]:
        """The runtime ended by itself (not on our stop); nothing when a refusal or ban already said why."""
        if self._said & {"refused", "banned"}:
            return []
        then = f"; {next_step}" if next_step else ""
        return self._say("dropped", f"the worker runtime dropped out ({reason}){then}", again=True)

    def _say(self, kind: NotifyKind, text: str, again: bool = False) -> list[Alert]:
        if kind in self._said and not again:
            return []
        self._said.add(kind)
        return [Alert(kind, f"{self._prefix}: {text}")]


class Notifier:
    """Runs the notify command for each alert in the background; ``report(line)`` hears of each failure."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        report: Callable[[str], None],
        secrets: Sequence[str] = (),
        timeout_s: float = NOTIFY_TIMEOUT_S,
        host: str | None = None,
    ) -> None:
        self.argv, self.report, self.timeout_s = tuple(argv), report, timeout_s
        self.secrets = tuple(secret for secret in secrets if secret)
        self.alerts = Alerts(host)
        self._running: set[asyncio.Task] = set()

    def event(self, event: Event) -> None:
        self._send(self.alerts.on_event(event))

    def runtime_ended(self, code: int | None, reason: str, next_step: str = "") -> None:
        self._send(self.alerts.on_end(code, reason, next_step))

    def _send(self, alerts: list[Alert]) -> None:
        if not self.argv:
            return
        for alert in alerts:
            task = asyncio.get_running_loop().create_task(self._run(alert))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, alert: Alert) -> None:
        message = redact_text(alert.message, self.secrets)[:MESSAGE_LIMIT]
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                message,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=self._environment(alert.kind, message),
                start_new_session=True,  # our terminal's Ctrl-C is not for it; a timeout kills its whole group
            )
        except OSError as error:
            self.report(
                f"Notification ({alert.kind}) not sent: could not run {self.argv[0]}: {error.strerror or error}"
            )
            return
        try:
            _, err = await asyncio.wait_for(process.communicate(), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as stopped:
            _kill_group(process.pid)
            await process.wait()
            if isinstance(stopped, asyncio.CancelledError):
                raise
            self.report(
                f"Notification ({alert.kind}) not sent: {self.argv[0]} took longer than {self.timeout_s:g}s; stopped it"
            )
            return
        if process.returncode != 0:
            said = redact_text(err.decode("utf-8", errors="replace").strip(), self.secrets).splitlines()[-1:]
            detail = f": {said[0][:120]}" if said else ""
            self.report(
                f"Notification ({alert.kind}) not sent: {self.argv[0]} ended with "
                f"{describe_end(process.returncode)}{detail}"
            )

    def _environment(self, kind: NotifyKind, message: str) -> dict[str, str]:
        env = {
            name: value
            for name, value in os.environ.items()
            if name not in _TOKEN_VARIABLES and value not in self.secrets
        }
        return {**env, "AGORA_NOTIFY_KIND": kind, "AGORA_NOTIFY_MESSAGE": message}

    async def aclose(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Let running notifications finish for up to ``grace_s``, then stop the rest."""
        if not self._running:
            return
        _, late = await asyncio.wait(set(self._running), timeout=grace_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
