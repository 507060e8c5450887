"""hivemind's log records, handed to the process's own logging."""

from __future__ import annotations

from hivemind.utils.logging import use_hivemind_log_handler

__all__ = ["propagate_hivemind_logs"]


def propagate_hivemind_logs() -> None:
    """Take hivemind's own stderr handler off its loggers: their records propagate to the root logger."""
    use_hivemind_log_handler("nowhere")
