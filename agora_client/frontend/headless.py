"""``agora_cli.py --headless``: the runtime's events as tagged console lines, for systemd, tmux and logs.

One line per event worth reading (see :mod:`agora_client.frontend.lines`), or with
``--log-format json`` one JSON object per line:
``{"ts": ..., "tag": "SYNC", "level": "info", "message": "...", "event": {...}}``.
SIGINT (Ctrl-C) and SIGTERM are forwarded to the runtime as a graceful stop; a line says so, and
nothing the runtime prints while it stops is shown but warnings and errors. The runtime's stderr
goes, redacted, to our stderr. Exit codes: :mod:`agora_client.frontend.exit_codes`.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import TextIO

from agora_client.events import AuthEvent
from agora_client.frontend.client import ClientSession
from agora_client.frontend.exit_codes import EXIT_ERROR, client_exit_code
from agora_client.frontend.lines import LineFormatter, TaggedLine
from agora_client.frontend.stream import EventLine, MalformedLine, StderrLine, read_runtime
from agora_client.frontend.supervisor import ChildCommand, RuntimeProcess
from agora_client.logs import EventLog

STOPPING = {
    signal.SIGINT: "Interrupted: stopping the worker (finishing the current request, freeing the slot)...",
    signal.SIGTERM: "Asked to stop: stopping the worker (finishing the current request, freeing the slot)...",
}


class HeadlessPrinter:
    """Writes tagged lines (text or JSON) for every event, malformed line and stderr line."""

    def __init__(self, out: TextIO, log_format: str = "text", formatter: LineFormatter | None = None) -> None:
        if log_format not in ("text", "json"):
            raise ValueError(f"log format {log_format!r} is not text or json")
        self.out = out
        self.log_format = log_format
        self.formatter = formatter or LineFormatter()
        self.stopping = False  # once set, only warnings and errors are printed

    def write(self, line: TaggedLine) -> None:
        if self.stopping and line.level not in ("warning", "error"):
            return
        self.out.write((line.render_json() if self.log_format == "json" else line.render()) + "\n")
        self.out.flush()

    def stop_requested(self, text: str) -> None:
        self.write(self.formatter.note(text, time.time()))
        self.stopping = True


async def run_headless(
    command: ChildCommand,
    printer: HeadlessPrinter,
    *,
    event_log: EventLog | None = None,
    err: TextIO = sys.stderr,
    interrupt_timeout_s: float | None = None,
) -> int:
    timeouts = {} if interrupt_timeout_s is None else {"interrupt_timeout_s": interrupt_timeout_s}
    process = RuntimeProcess(command, **timeouts)
    loop = asyncio.get_running_loop()
    stop_signal: int | None = None
    stop_requested = asyncio.Event()

    def request_stop(signum: int) -> None:
        nonlocal stop_signal
        if stop_signal is None:
            stop_signal = signum
            printer.stop_requested(STOPPING[signum])
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
            printer.write(printer.formatter.note(text, time.time(), "ERROR", "error"))
            return EXIT_ERROR

        async def stop_when_asked() -> None:
            await stop_requested.wait()
            await process.stop()

        stopper = asyncio.create_task(stop_when_asked())
        async for item in read_runtime(process, event_log=event_log):
            if isinstance(item, StderrLine):
                err.write(item.text + "\n")
                err.flush()
            elif isinstance(item, MalformedLine):
                printer.write(printer.formatter.malformed(item.reason, item.raw, item.ts))
            elif isinstance(item, EventLine):
                event = item.event
                rejected = rejected or (isinstance(event, AuthEvent) and event.status == "rejected")
                for line in printer.formatter.format(event):
                    printer.write(line)
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
    return client_exit_code(code, stop_signal, rejected)


def run_session(session: ClientSession) -> int:
    """The headless front end for a prepared client session."""
    printer = HeadlessPrinter(sys.stdout, session.log_format)
    return asyncio.run(run_headless(session.command, printer, event_log=session.event_log()))
