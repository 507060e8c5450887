"""``agora_cli.py --headless``: run the runtime child and print its events as tagged lines.

Exit codes are documented in :mod:`agora_client.headless`. SIGINT (Ctrl-C) and SIGTERM are
forwarded to the child as a graceful stop; the child's stderr goes, redacted, to our stderr.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import TextIO

from agora_client.events import AuthEvent, BadEvent, LogEvent, parse_event
from agora_client.headless import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_RUNTIME_ERROR,
    EXIT_USAGE,
    HeadlessPrinter,
    TaggedLine,
)
from agora_client.logs import EventLog
from agora_client.system.redact import redact_text
from tui.supervisor import ChildCommand, RuntimeProcess

OVERSIZE_REASON = "line longer than 1 MiB"


def exit_code(child_code: int | None, stop_signal: int | None, rejected: bool) -> int:
    """The headless client's exit code from how the child ended and why."""
    if stop_signal == signal.SIGINT:
        return EXIT_INTERRUPTED
    if stop_signal == signal.SIGTERM:
        return EXIT_OK  # a service manager asked for the stop and got it
    if rejected or child_code == EXIT_REJECTED:
        return EXIT_REJECTED
    if child_code in (EXIT_OK, EXIT_USAGE):
        return child_code
    return EXIT_RUNTIME_ERROR


async def run_headless(
    command: ChildCommand,
    printer: HeadlessPrinter,
    *,
    event_log: EventLog | None = None,
    err: TextIO = sys.stderr,
    interrupt_timeout_s: float | None = None,
) -> int:
    process = RuntimeProcess(command) if interrupt_timeout_s is None else RuntimeProcess(command, interrupt_timeout_s=interrupt_timeout_s)
    loop = asyncio.get_running_loop()
    stop_signal: int | None = None
    stop_requested = asyncio.Event()

    def request_stop(signum: int) -> None:
        nonlocal stop_signal
        stop_signal = stop_signal or signum
        stop_requested.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)
    stopper: asyncio.Task | None = None
    rejected = False
    try:
        try:
            await process.start()
        except OSError as error:
            text = f"Could not start the runtime ({command.argv[0]}): {error}"
            printer.write(TaggedLine(time.time(), "ERROR", "error", text))
            return EXIT_RUNTIME_ERROR

        async def stop_when_asked() -> None:
            await stop_requested.wait()
            await process.stop()

        stopper = asyncio.create_task(stop_when_asked())
        async for stream, text in process.lines():
            if stream == "stderr":
                safe = redact_text(text)
                err.write(safe + "\n")
                err.flush()
                if event_log:
                    event_log.write_event(LogEvent(level="warning", tag="STDERR", message=safe))
                continue
            if stream == "oversize":
                printer.malformed(OVERSIZE_REASON, "", time.time())
                continue
            if event_log:
                event_log.write_line(text)
            try:
                event = parse_event(text)
            except BadEvent as error:
                printer.malformed(str(error), text, time.time())
                continue
            rejected = rejected or (isinstance(event, AuthEvent) and event.status == "rejected")
            printer.event(event)
        code = await process.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if stopper is not None:
            stopper.cancel()
        if process.running:
            await process.stop()
        if event_log:
            event_log.close()
    return exit_code(code, stop_signal, rejected)
