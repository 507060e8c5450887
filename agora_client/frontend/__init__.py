"""What every front end shares, with no Textual in it: the runtime supervisor, the one reader of
the runtime's stream, the exit-code table, tagged lines, the headless printer, the restart policy
(``--restart``, restart.py) and notifications (``--notify-cmd``, notify.py).

The app (tui/) and the headless client both run on this; agora_cli.py chooses between them.
"""

from agora_client.frontend.client import ClientSession, FrontEnd
from agora_client.frontend.exit_codes import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_USAGE,
    client_exit_code,
)
from agora_client.frontend.lines import LineFormatter, TaggedLine
from agora_client.frontend.stream import EventLine, MalformedLine, StderrLine, StreamItem, read_runtime
from agora_client.frontend.supervisor import ChildCommand, RuntimeProcess, runtime_command

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REJECTED",
    "EXIT_USAGE",
    "ChildCommand",
    "ClientSession",
    "EventLine",
    "FrontEnd",
    "LineFormatter",
    "MalformedLine",
    "RuntimeProcess",
    "StderrLine",
    "StreamItem",
    "TaggedLine",
    "client_exit_code",
    "read_runtime",
    "runtime_command",
]
