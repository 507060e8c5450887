"""The one reader of the runtime's output: parsed events, malformed lines and stderr lines.

Every stdout line goes to the event log as received (redacted there); stderr is redacted here
before anyone sees it, and a Python traceback is folded into one line (its last, the error
itself) while the event log keeps the whole text for the support bundle.
"""

from __future__ import annotations

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
    """Collects a traceback's lines and gives back one line when its final (error) line arrives."""

    def __init__(self) -> None:
        self._block: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        """(line to show, whole text) once a line or a whole traceback is complete, else None."""
        opens_block = line.startswith((_TRACEBACK_START, *_TRACEBACK_LINKS))
        if not self._block:
            if opens_block:
                self._block = [line]
                return None
            return (line, "") if line.strip() else None
        self._block.append(line)
        if opens_block or line.startswith((" ", "\t")) or not line.strip():
            return None
        block, self._block = self._block, []
        return line, "\n".join(block)

    def flush(self) -> tuple[str, str] | None:
        """What is left of a traceback cut short (the process died while writing it)."""
        if not self._block:
            return None
        block, self._block = self._block, []
        return block[-1].strip() or "a traceback", "\n".join(block)


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
            folded = folder.feed(text)
            if folded is not None:
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
    rest = folder.flush()
    if rest is not None:
        yield stderr_item(rest)
