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

from agora_client.events import AuthEvent, Event
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
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
    """Run the runtime, print its output until it exits (SIGINT/SIGTERM stop it gracefully); the exit code."""
    timeouts = {} if interrupt_timeout_s is None else {"interrupt_timeout_s": interrupt_timeout_s}
    run = _HeadlessRun(RuntimeProcess(command, **timeouts), printer, event_log, err)
    loop = asyncio.get_running_loop()
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, run.request_stop, signum)
    try:
        if not await run.start(command.argv[0]):
            return EXIT_ERROR
        run.stop_when_asked()
        await run.show_output()
        code = await run.process.wait()
    finally:
        for signum in _STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        await run.clean_up()
    return client_exit_code(code, run.stop_signal, run.rejected)


class _HeadlessRun:
    """One headless run: the runtime process, where its output goes, and whether it was asked to stop."""

    def __init__(self, process: RuntimeProcess, printer: HeadlessPrinter, event_log: EventLog | None, err: TextIO):
        self.process, self.printer, self.event_log, self.err = process, printer, event_log, err
        self.stop_signal: int | None = None  # the first stop signal received
        self.stop_requested = asyncio.Event()
        self.stopper: asyncio.Task | None = None
        self.rejected = False  # the swarm turned the join away

    def request_stop(self, signum: int) -> None:
        """A signal handler: the first signal prints why the worker stops and asks it to; a second one hurries it."""
        if self.stop_signal is None:
            self.stop_signal = signum
            self.printer.stop_requested(STOPPING[signum])
        else:
            self.process.hurry()
        self.stop_requested.set()

    async def start(self, program: str) -> bool:
        """Start the runtime; False (after an error line) if it could not be started."""
        try:
            await self.process.start()
        except OSError as error:
            text = f"Could not start the runtime ({program}): {error}"
            self.printer.write(self.printer.formatter.note(text, time.time(), "ERROR", "error"))
            return False
        return True

    def stop_when_asked(self) -> None:
        """Stop the runtime, in the background, once a stop is requested."""
        self.stopper = asyncio.create_task(self._stop_on_request())

    async def _stop_on_request(self) -> None:
        await self.stop_requested.wait()
        await self.process.stop()

    async def show_output(self) -> None:
        """Relay everything the runtime writes until its output ends."""
        async for item in read_runtime(self.process, event_log=self.event_log):
            if isinstance(item, StderrLine):
                self.err.write(item.text + "\n")
                self.err.flush()
            elif isinstance(item, MalformedLine):
                self.printer.write(self.printer.formatter.malformed(item.reason, item.raw, item.ts))
            elif isinstance(item, EventLine):
                self._show_event(item.event)

    def _show_event(self, event: Event) -> None:
        self.rejected = self.rejected or (isinstance(event, AuthEvent) and event.status == "rejected")
        for line in self.printer.formatter.format(event):
            self.printer.write(line)

    async def clean_up(self) -> None:
        """Cancel the stopper, stop the runtime if it still runs, close the event log."""
        if self.stopper is not None:
            self.stopper.cancel()
        if self.process.running:
            await self.process.stop()
        if self.event_log:
            self.event_log.close()


def run_session(session: ClientSession) -> int:
    """The headless front end for a prepared client session."""
    printer = HeadlessPrinter(sys.stdout, session.log_format)
    return asyncio.run(run_headless(session.command, printer, event_log=session.event_log()))
