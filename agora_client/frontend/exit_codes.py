"""The one exit-code table of the runtime, the app and the headless client.

| code | meaning |
| --- | --- |
| 0 | clean stop (``q`` in the app, SIGTERM from a service manager, or the runtime stopped on request) |
| 1 | runtime error (the runtime crashed or could not reach the swarm; with ``--restart on-failure``, too many crashes) |
| 2 | bad usage or config (bad flag, no token or swarm in a non-interactive start, unknown GPU) |
| 3 | rejected by the swarm (token refused, swarm full, or this identity's cap reached) |
| 130 | interrupted (Ctrl-C; the runtime was stopped gracefully first) |
"""  # noqa: E501 - a Markdown table row cannot be wrapped

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_REJECTED = 3
EXIT_INTERRUPTED = 130

MEANING = {
    EXIT_OK: "clean stop",
    EXIT_ERROR: "runtime error",
    EXIT_USAGE: "bad usage or config",
    EXIT_REJECTED: "rejected by the swarm",
    EXIT_INTERRUPTED: "interrupted",
}


def client_exit_code(runtime_code: int | None, stop_signal: int | None, rejected: bool = False) -> int:
    """The client's exit code (app or headless) from how the runtime ended and what stopped it.

    ``stop_signal``: SIGINT for Ctrl-C, SIGTERM for a service manager's stop, None when the runtime
    ended by itself (or ``q`` asked it to stop, which passes ``runtime_code`` 0).
    """
    if stop_signal == signal.SIGINT:
        return EXIT_INTERRUPTED
    if stop_signal == signal.SIGTERM:
        return EXIT_OK  # a service manager asked for the stop and got it
    if rejected or runtime_code == EXIT_REJECTED:
        return EXIT_REJECTED
    if runtime_code in (EXIT_OK, EXIT_USAGE):
        return runtime_code
    return EXIT_ERROR
