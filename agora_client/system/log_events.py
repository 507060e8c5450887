"""Python log records as events: what the runtime's libraries log reaches the front end as one
``log`` event per record, never as raw text (or a traceback) on stderr.

A record with an exception becomes one line ending in the exception's type and message. What
the averager logs about a round is said by the round's own ``sparta`` event, so it is kept at
debug level (in the JSONL log, not on screen).
"""

from __future__ import annotations

import logging

from agora_client.events import EventWriter, Level, LogEvent

_ROUND_LOGGERS = ("hivemind.averaging", "hivemind.optim.progress_tracker")


class EventLogHandler(logging.Handler):
    def __init__(self, events: EventWriter) -> None:
        super().__init__(level=logging.INFO)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = record.getMessage().strip().splitlines() or [""]
            message = lines[0]
            if record.exc_info and record.exc_info[1] is not None:
                error = record.exc_info[1]
                message = f"{message} ({type(error).__name__}: {error})".strip()
            self.events.emit(LogEvent(level=_level(record), tag="ENGINE", message=f"{record.name}: {message}"))
        except Exception:  # logging must never take the runtime down
            self.handleError(record)


def _level(record: logging.LogRecord) -> Level:
    if record.levelno < logging.WARNING or record.name.startswith(_ROUND_LOGGERS):
        return "debug"
    return "error" if record.levelno >= logging.ERROR else "warning"


def logs_to_events(events: EventWriter, engine_level: int = logging.WARNING) -> None:
    """Send every log record of this process (and of the helpers it forks) to ``events`` instead of stderr."""
    from agora_client.engine.logs import propagate_hivemind_logs

    propagate_hivemind_logs()  # hivemind's records go to the root logger, handled here
    for name in ("hivemind", "httpx", "httpcore"):  # their routine records (every request) are not news
        logging.getLogger(name).setLevel(engine_level)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(EventLogHandler(events))
    root.setLevel(logging.INFO)
