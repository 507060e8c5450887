"""``agora_cli.py --headless``: the runtime's events as tagged console lines, for systemd, tmux and logs.

One line per event worth reading (see :mod:`agora_client.frontend.lines`), or with
``--log-format json`` one JSON object per line:
``{"ts": ..., "tag": "SYNC", "level": "info", "message": "...", "event": {...}}``.
SIGINT (Ctrl-C) and SIGTERM are forwarded to the runtime as a graceful stop; a line says so, and
nothing the runtime prints while it stops is shown but warnings and errors. The runtime's stderr
goes, redacted, to our stderr. Exit codes: :mod:`agora_client.frontend.exit_codes`.
With ``--restart on-failure`` a crashed runtime starts again after a ``[RESTART]`` line that says why
(:mod:`agora_client.frontend.restart`); ``--notify-cmd`` runs a command on what an absent owner wants
to hear of (:mod:`agora_client.frontend.notify`).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Sequence, TextIO

from agora_client.events import AuthEvent, Event
from agora_client.frontend.client import ClientSession
from agora_client.frontend.exit_codes import EXIT_ERROR, client_exit_code
from agora_client.frontend.lines import LineFormatter, TaggedLine
from agora_client.frontend.notify import Notifier
from agora_client.frontend.restart import LastWords, RestartPolicy, next_step
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

    def warn(self, text: str) -> None:
        """A warning the front end says itself (a notification that could not be sent)."""
        self.write(self.formatter.note(text, time.time(), "WARNING", "warning"))


async def run_headless(
    command: ChildCommand,
    printer: HeadlessPrinter,
    *,
    event_log: EventLog | None = None,
    err: TextIO = sys.stderr,
    interrupt_timeout_s: float | None = None,
    restart: RestartPolicy | None = None,
    notify_cmd: Sequence[str] = (),
    secrets: Sequence[str] = (),
) -> int:
    """Run the runtime, print its output until it exits (SIGINT/SIGTERM stop it gracefully), start it again after
    a crash if ``restart`` says so; the exit code."""
    timeouts = {} if interrupt_timeout_s is None else {"interrupt_timeout_s": interrupt_timeout_s}
    notifier = Notifier(notify_cmd, report=printer.warn, secrets=secrets)
    run = _HeadlessRun(printer, event_log, err, notifier)
    policy = restart or RestartPolicy()
    loop = asyncio.get_running_loop()
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, run.request_stop, signum)
    try:
        while True:
            code = await run.run_once(RuntimeProcess(command, **timeouts))
            if code is None:
                return EXIT_ERROR
            if not await run.restart_after(code, policy):
                break
    finally:
        for signum in _STOP_SIGNALS:
            loop.remove_signal_handler(signum)
        await run.clean_up()
    return client_exit_code(code, run.stop_signal, run.rejected)


class _HeadlessRun:
    """The headless session: the current runtime process, where its output goes, and whether it was asked to stop."""

    def __init__(self, printer: HeadlessPrinter, event_log: EventLog | None, err: TextIO, notifier: Notifier):
        self.printer, self.event_log, self.err, self.notifier = printer, event_log, err, notifier
        self.process: RuntimeProcess | None = None
        self.stop_signal: int | None = None  # the first stop signal received
        self.stop_requested = asyncio.Event()
        self.stopper: asyncio.Task | None = None
        self.rejected = False  # the swarm turned the join away
        self.last_words = LastWords()

    def request_stop(self, signum: int) -> None:
        """A signal handler: the first signal prints why the worker stops and asks it to; a second one hurries it."""
        if self.stop_signal is None:
            self.stop_signal = signum
            self.printer.stop_requested(STOPPING[signum])
        elif self.process is not None:
            self.process.hurry()
        self.stop_requested.set()

    async def run_once(self, process: RuntimeProcess) -> int | None:
        """One run of the runtime, from its start to its exit code; None (after an error line) if it could not start."""
        if self.stopper is not None:  # the previous run's: it has nothing left to stop
            self.stopper.cancel()
        self.process, self.last_words = process, LastWords()
        self.printer.formatter = self.printer.formatter.fresh()  # throttling and "said already" start afresh
        self.notifier.alerts.new_run()
        try:
            await process.start()
        except OSError as error:
            text = f"Could not start the runtime ({process.command.argv[0]}): {error}"
            self.printer.write(self.printer.formatter.note(text, time.time(), "ERROR", "error"))
            return None
        # Stops this run once a stop is asked for, even one that came while it was starting.
        self.stopper = asyncio.create_task(self._stop_on_request(process))
        await self.show_output()
        return await process.wait()

    async def _stop_on_request(self, process: RuntimeProcess) -> None:
        await self.stop_requested.wait()
        await process.stop()

    async def restart_after(self, code: int, policy: RestartPolicy) -> bool:
        """After a run: notify if it dropped out, say whether it starts again, and wait for that; False to end here."""
        assert self.process is not None
        if self.stop_requested.is_set() or self.process.stop_requested:
            return False  # q, Ctrl-C or SIGTERM: a stop, never a crash
        reason = self.last_words.reason(code)
        decision = policy.after_end(code, reason)
        self.notifier.runtime_ended(code, reason, next_step(decision))
        if decision is None:
            return False
        if decision.gives_up:
            self.printer.write(self.printer.formatter.note(decision.text, time.time(), "ERROR", "error"))
            return False
        self.printer.write(self.printer.formatter.note(decision.text, time.time(), "RESTART", "warning"))
        try:  # a stop asked for while waiting ends the session at once
            await asyncio.wait_for(self.stop_requested.wait(), decision.delay_s)
        except asyncio.TimeoutError:
            return True
        return False

    async def show_output(self) -> None:
        """Relay everything the runtime writes until its output ends."""
        assert self.process is not None
        async for item in read_runtime(self.process, event_log=self.event_log):
            self.last_words.observe(item)
            if isinstance(item, StderrLine):
                self.err.write(item.text + "\n")
                self.err.flush()
            elif isinstance(item, MalformedLine):
                self.printer.write(self.printer.formatter.malformed(item.reason, item.raw, item.ts))
            elif isinstance(item, EventLine):
                self._show_event(item.event)

    def _show_event(self, event: Event) -> None:
        self.rejected = self.rejected or (isinstance(event, AuthEvent) and event.status == "rejected")
        self.notifier.event(event)
        for line in self.printer.formatter.format(event):
            self.printer.write(line)

    async def clean_up(self) -> None:
        """Cancel the stopper, stop the runtime if it still runs, let notifications finish, close the event log."""
        if self.stopper is not None:
            self.stopper.cancel()
        if self.process is not None and self.process.running:
            await self.process.stop()
        await self.notifier.aclose()
        if self.event_log:
            self.event_log.close()


def run_session(session: ClientSession) -> int:
    """The headless front end for a prepared client session."""
    printer = HeadlessPrinter(sys.stdout, session.log_format)
    return asyncio.run(
        run_headless(
            session.command,
            printer,
            event_log=session.event_log(),
            restart=session.restart_policy(),
            notify_cmd=session.notify_cmd,
            secrets=session.secrets,
        )
    )
