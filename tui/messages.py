"""Messages from the runtime supervisor worker to the app."""

from __future__ import annotations

from textual.message import Message

from agora_client.events import DownloadEvent, Event
from agora_client.frontend import TaggedLine

# Kinds where only the newest pending message matters: a newer one replaces a queued older one.
_REPLACEABLE_KINDS = frozenset({"resources"})


def _replace_key(event: Event) -> tuple[str, str] | None:
    if event.kind in _REPLACEABLE_KINDS:
        return (event.kind, "")
    if isinstance(event, DownloadEvent) and event.status == "progress":
        return ("download", event.file)
    return None


class RuntimeStarted(Message):
    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid


class RuntimeEvent(Message):
    """One valid event from the runtime's stdout (already written to the event log), with the
    log-pane lines it produced. A queued high-rate event with no lines is superseded by a newer one."""

    def __init__(self, event: Event, lines: list[TaggedLine]) -> None:
        super().__init__()
        self.event = event
        self.lines = lines
        self.replace_key = _replace_key(event)

    def can_replace(self, message: Message) -> bool:
        # Called on the older queued message with the newer one: True drops the older.
        return (
            isinstance(message, RuntimeEvent)
            and self.replace_key is not None
            and message.replace_key == self.replace_key
            and not self.lines
        )


class RuntimeMalformed(Message):
    """A stdout line that is not a valid event."""

    def __init__(self, reason: str, raw: str, ts: float) -> None:
        super().__init__()
        self.reason = reason
        self.raw = raw
        self.ts = ts


class RuntimeStderr(Message):
    def __init__(self, text: str, ts: float) -> None:
        super().__init__()
        self.text = text
        self.ts = ts


class RuntimeExited(Message):
    """The runtime is gone: its exit code (None if it never started) and whether we asked it to stop."""

    def __init__(self, code: int | None, stop_requested: bool, detail: str = "") -> None:
        super().__init__()
        self.code = code
        self.stop_requested = stop_requested
        self.detail = detail
