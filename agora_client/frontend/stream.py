"""The one reader of the runtime's output: parsed events, malformed lines and stderr lines.

Every stdout line goes to the event log as received (redacted there); stderr is redacted here
before anyone sees it, and a Python traceback is folded into one line (its last, the error
itself), as is the stack dump of a stop that hangs (system/lifetime.py), while the event log keeps
the whole text for the support bundle.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from agora_client.events import BadEvent, Event, LogEvent, parse_event
from agora_client.frontend.supervisor import RuntimeProcess
from agora_client.logs import EventLog
from agora_client.system.redact import redact_text

OVERSIZE_REASON = "line longer than 1 MiB"
_TRACEBACK_START = "Traceback (most recent call last):"
_TRACEBACK_LINKS = (
    "During handling of the above exception",
    "The above exception was the direct cause",
)
_STACK_DUMP_START = re.compile(r"Timeout \((\d+:\d\d:\d\d)\)!$")  # faulthandler's watchdog, a stuck stop's
_STACK_DUMP_THREAD = ("Thread 0x", "Current thread 0x")


@dataclass(frozen=True)
class EventLine:
    event: Event
    raw: str


@dataclass(frozen=True)
class MalformedLine:
    reason: str
    raw: str
    ts: float


@dataclass(frozen=True)
class StderrLine:
    text: str  # redacted; a traceback is its final line
    ts: float
    detail: str = ""  # the whole traceback, redacted, when text stands for one


StreamItem = EventLine | MalformedLine | StderrLine


class TracebackFolder:
    """Collects a traceback's lines and gives back one line when its final (error) line arrives; and a stack dump,
    which has no final line, when a line that is not part of it arrives."""

    def __init__(self) -> None:
        self._block: list[str] = []
        self._dump: list[str] = []

    def feed(self, line: str) -> list[tuple[str, str]]:
        """(line to show, whole text) for each line or whole traceback or stack dump this line completes."""
        if self._dump:
            if line.startswith((*_STACK_DUMP_THREAD, " ", "\t")) or not line.strip():
                self._dump.append(line)
                return []
            return [self._end_dump(), *self.feed(line)]
        opens_block = line.startswith((_TRACEBACK_START, *_TRACEBACK_LINKS))
        if not self._block:
            if opens_block:
                self._block = [line]
                return []
            if _STACK_DUMP_START.match(line):
                self._dump = [line]
                return []
            return [(line, "")] if line.strip() else []
        self._block.append(line)
        if opens_block or line.startswith((" ", "\t")) or not line.strip():
            return []
        block, self._block = self._block, []
        return [(line, "\n".join(block))]

    def flush(self) -> list[tuple[str, str]]:
        """What is left: a stack dump, or a traceback cut short (the process died while writing it)."""
        if self._dump:
            return [self._end_dump()]
        if not self._block:
            return []
        block, self._block = self._block, []
        return [(block[-1].strip() or "a traceback", "\n".join(block))]

    def _end_dump(self) -> tuple[str, str]:
        dump, self._dump = self._dump, []
        waited = _STACK_DUMP_START.match(dump[0]).group(1)
        threads = sum(line.startswith(_STACK_DUMP_THREAD) for line in dump)
        shown = f"the stop was still under way after {waited}: the stacks of its {threads} threads are in the log"
        return shown, "\n".join(dump).rstrip("\n")


async def read_runtime(
    process: RuntimeProcess,
    *,
    event_log: EventLog | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[StreamItem]:
    """Items from a started runtime until both of its streams close."""
    folder = TracebackFolder()

    def stderr_item(folded: tuple[str, str]) -> StderrLine:
        text, detail = redact_text(folded[0]), redact_text(folded[1])
        if event_log:
            event_log.write_event(LogEvent(level="warning", tag="STDERR", message=detail or text))
        return StderrLine(text, clock(), detail)

    async for stream, text in process.lines():
        if stream == "stderr":
            for folded in folder.feed(text):
                yield stderr_item(folded)
            continue
        if stream == "oversize":
            yield MalformedLine(OVERSIZE_REASON, "", clock())
            continue
        if event_log:
            event_log.write_line(text)
        try:
            yield EventLine(parse_event(text), text)
        except BadEvent as error:
            yield MalformedLine(str(error), text, clock())
    for rest in folder.flush():
        yield stderr_item(rest)
