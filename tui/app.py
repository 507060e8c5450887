"""The contributor app: supervises the worker runtime process and shows its event stream live.

The app never imports worker internals: it starts ``command`` (any argv + env: the real runtime,
or a recorded-stream replayer in tests), reads one JSON event per stdout line and updates its
panels. Before authorization the preflight view (each check, and the diagnosis while the swarm
cannot reach the worker) takes the dashboard's place. If the child dies, the app says why and
offers a restart (with --restart on-failure it starts a crashed one again by itself, see
agora_client.frontend.restart); quitting, Ctrl-C, SIGINT and SIGTERM stop it gracefully and never restart.
--notify-cmd: agora_client.frontend.notify.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import tzinfo
from pathlib import Path
from typing import Callable, Iterable, Sequence

from textual import events, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, TabbedContent

from agora_client.events import AuthEvent, ErrorEvent, ExitEvent
from agora_client.frontend import (
    EXIT_OK,
    ChildCommand,
    EventLine,
    LineFormatter,
    MalformedLine,
    RuntimeProcess,
    StderrLine,
    TaggedLine,
    client_exit_code,
    read_runtime,
)
from agora_client.frontend.notify import Notifier
from agora_client.frontend.restart import RestartDecision, RestartPolicy, describe_end, next_step
from agora_client.frontend.supervisor import INTERRUPT_TIMEOUT_S, TERMINATE_TIMEOUT_S
from agora_client.logs import EventLog
from agora_client.system.bundle import REVIEW_NOTE, build_bundle
from tui.messages import RuntimeEvent, RuntimeExited, RuntimeMalformed, RuntimeStarted, RuntimeStderr
from tui.screens.help import HelpScreen
from tui.state import JoinTracker
from tui.widgets import (
    Dashboard,
    JoinPanel,
    LogPane,
    PreflightPanel,
    ReachabilityPanel,
    RuntimeStatus,
    StatusBand,
    Stepper,
)
from tui.widgets.dashboard import LOG_TAB, TABS

STDERR_TAIL = 20
WIDE, NARROW, SHORT = 150, 70, 30  # terminal sizes where the layout changes


@dataclass(frozen=True)
class BundleTarget:
    """Where the `e` key writes a support bundle and what it reads."""

    config_dir: Path
    logs_dir: Path
    output_dir: Path
    secrets: tuple[str, ...] = field(default=(), repr=False)


class AgoraApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "Agora"
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit", tooltip="Stop the worker gracefully and quit"),
        Binding("ctrl+c", "interrupt", "Quit", show=False, priority=True, id="quit_ctrl_c"),
        Binding("e", "export_bundle", "Export bundle", id="export_bundle", tooltip="Write a support bundle (zip)"),
        Binding("l", "toggle_logs", "Logs", id="toggle_logs", tooltip="Show or hide the log pane"),
        Binding(
            "p", "toggle_preflight", "Preflight", id="toggle_preflight", tooltip="Show or hide the preflight checks"
        ),
        Binding("r", "retry", "Retry now", id="retry", tooltip="Ask the swarm to connect back to this worker now"),
        Binding("r", "restart", "Restart", id="restart", tooltip="Start the worker runtime again"),
        Binding("question_mark", "help", "Help", key_display="?", id="help", tooltip="What the panels mean"),
        Binding("space", "toggle_pause", "Pause/resume", show=False, id="toggle_pause", tooltip="agora pause / resume"),
        *(
            Binding(str(number), f"show_tab('{tab}')", title, show=False, id=tab)
            for number, (tab, title) in enumerate(TABS.items(), 1)
        ),
    ]

    def __init__(
        self,
        command: ChildCommand,
        *,
        event_log: EventLog | None = None,
        bundle: BundleTarget | None = None,
        tz: tzinfo | None = None,
        interrupt_timeout_s: float = INTERRUPT_TIMEOUT_S,
        terminate_timeout_s: float = TERMINATE_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        restart: RestartPolicy | None = None,
        notify_cmd: Sequence[str] = (),
        secrets: Sequence[str] = (),
        pause_control: Callable[[], str] | None = None,
    ) -> None:
        super().__init__()
        self.command = command
        self.event_log = event_log
        self.bundle = bundle
        self.tz = tz
        self.clock = clock  # stamps lines the app makes itself (stderr, status); tests fix it
        self.interrupt_timeout_s = interrupt_timeout_s
        self.terminate_timeout_s = terminate_timeout_s
        self.tracker = JoinTracker()
        self.formatter = LineFormatter()
        self.process: RuntimeProcess | None = None
        self.lines_read = 0  # stdout lines read from the current child (valid or not)
        self.last_error: ErrorEvent | None = None
        self.last_exit: ExitEvent | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.quitting = False
        self.rejected = False  # the swarm turned this client away (exit code 3)
        self.ended_code: int | None = None  # exit code of a runtime that ended by itself
        self.runtime_stopped = False  # the current runtime has ended (nothing pending in the preflight will come)
        self.last_bundle: Path | None = None
        self.preflight_choice: bool | None = None  # p pressed: show (or hide) the preflight view whatever the step
        self.log_choice: bool | None = None  # l pressed: show (or hide) the log pane under the tabs whatever the size
        self.tab_before_log = "tab-contribution"  # where l goes back to from the Log tab
        self._was_in_preflight = False
        self._binding_state: tuple[bool, bool] = (False, False)  # (preflight seen, unreachable): the keys offered
        self._signals: list[int] = []  # stop signals this app handles (SIGINT, SIGTERM) while it runs
        self.restart_policy = restart or RestartPolicy()  # --restart: what follows a crash
        self.restart_timer: Timer | None = None  # set while a crashed runtime waits to start again
        self.notifier = Notifier(notify_cmd, report=self._warn, secrets=secrets)
        self.pause_control = pause_control  # pauses or resumes the runtime, as agora pause / resume; says what it did

    # -- layout -----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Stepper(id="stepper")
        yield RuntimeStatus(id="runtime-status")
        yield StatusBand(id="band")  # every mission figure, whatever the tab
        # Before authorization: the preflight checks, and what to open while the swarm cannot reach us.
        with VerticalScroll(id="preflight-view"):
            yield ReachabilityPanel(self.clock, id="reachability", classes="panel")
            yield PreflightPanel(id="preflight", classes="panel")
        yield Dashboard(tz=self.tz, id="dashboard")
        yield LogPane(tz=self.tz, id="log-pane", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(RuntimeStatus).hide()
        self._handle_stop_signals()
        self._show_step()
        self.supervise()

    def _handle_stop_signals(self) -> None:
        """SIGTERM (a service manager, `kill`) and SIGINT from outside stop the runtime gracefully, as in
        headless mode: without this the app would die at once, leaving the terminal in raw mode and the
        runtime to stop on its own. Only where the loop can take signals (the main thread)."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, lambda signum=signum: self.call_later(self._quit, signum))
            except (RuntimeError, ValueError, NotImplementedError):  # not the main thread, or no signals here
                continue
            self._signals.append(signum)

    def on_resize(self, event: events.Resize) -> None:
        width, height = event.size  # self.size may still hold the size before this resize
        self.set_class(width >= WIDE, "-wide")
        self.set_class(width < NARROW, "-narrow")
        self.set_class(height < SHORT, "-short")
        self._place_log()

    # -- the runtime child ------------------------------------------------------------------
    @work(exclusive=True, group="runtime", exit_on_error=False)
    async def supervise(self) -> None:
        process = RuntimeProcess(
            self.command, interrupt_timeout_s=self.interrupt_timeout_s, terminate_timeout_s=self.terminate_timeout_s
        )
        self.process = process
        self.lines_read = 0
        self.formatter = LineFormatter()  # throttling starts afresh with each run
        self.notifier.alerts.new_run()
        try:
            await process.start()
        except OSError as error:
            self.post_message(RuntimeExited(None, False, f"{self.command.argv[0]}: {error}"))
            return
        self.post_message(RuntimeStarted(process.pid or 0))
        try:
            async for item in read_runtime(process, event_log=self.event_log, clock=self.clock):
                if isinstance(item, StderrLine):
                    self.post_message(RuntimeStderr(item.text, item.ts))
                elif isinstance(item, MalformedLine):
                    self.lines_read += 1
                    self.post_message(RuntimeMalformed(item.reason, item.raw, item.ts))
                elif isinstance(item, EventLine):
                    self.lines_read += 1
                    # Lines are made here, before any coalescing, so the log pane misses none.
                    self.post_message(RuntimeEvent(item.event, self.formatter.format(item.event)))
            code = await process.wait()
            self.post_message(RuntimeExited(code, process.stop_requested))
        finally:
            if process.running:  # cancelled: the app is closing without a graceful stop
                process.kill()

    async def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self._signals:
            loop.remove_signal_handler(signum)
        self._signals.clear()
        if self.process is not None:  # whatever way the app ends, it leaves no process behind
            await self.process.aclose()
        await self.notifier.aclose()

    def on_runtime_started(self, message: RuntimeStarted) -> None:
        self._log(TaggedLine(self.clock(), "INFO", "info", "Worker runtime started"))
        self.refresh_bindings()

    def on_runtime_event(self, message: RuntimeEvent) -> None:
        event = message.event
        self.notifier.event(event)
        if self.tracker.apply(event):
            self._show_step()
        self.query_one(StatusBand).show(event)
        self.query_one(Dashboard).show(event)
        if isinstance(event, AuthEvent):
            self.rejected = self.rejected or event.status == "rejected"
        elif isinstance(event, ErrorEvent):
            self.last_error = event
        elif isinstance(event, ExitEvent):
            self.last_exit = event
        for line in message.lines:
            self._log(line)

    def on_runtime_malformed(self, message: RuntimeMalformed) -> None:
        self._log(self.formatter.malformed(message.reason, message.raw, message.ts))

    def on_runtime_stderr(self, message: RuntimeStderr) -> None:
        self.stderr_tail.append(message.text)
        self._log(self.formatter.stderr(message.text, message.ts))

    def on_runtime_exited(self, message: RuntimeExited) -> None:
        self.runtime_stopped = True
        self.refresh_bindings()
        self._show_preflight()
        if message.stop_requested or self.quitting:
            return
        self.ended_code = message.code
        reason = message.detail
        hint = ""
        if self.last_error is not None:
            reason, hint = self.last_error.message, self.last_error.hint
        elif self.last_exit is not None and self.last_exit.reason:
            reason = self.last_exit.reason
        elif not reason and self.stderr_tail:
            reason = self.stderr_tail[-1]
        self.tracker.child_exited(message.code, reason or describe_end(message.code), hint)
        self._show_step()
        ended = f"{describe_end(message.code)}: {reason}" if reason else describe_end(message.code)
        decision = self.restart_policy.after_end(message.code, ended)
        self.notifier.runtime_ended(message.code, ended, next_step(decision))
        if decision is not None:
            self._after_crash(decision)
            if not decision.gives_up:
                return
        detail = message.detail or (f"last output: {self.stderr_tail[-1]}" if self.stderr_tail else "")
        self.query_one(RuntimeStatus).show_stopped(message.code, detail)
        code = describe_end(message.code)
        self._log(
            TaggedLine(self.clock(), "ERROR", "error", f"The worker runtime stopped ({code}); press r to restart")
        )

    def _after_crash(self, decision: RestartDecision) -> None:
        """--restart on-failure: say why and start the runtime again after the delay, or say that it gave up."""
        if decision.gives_up:
            self._log(TaggedLine(self.clock(), "ERROR", "error", decision.text))
            return
        self._log(TaggedLine(self.clock(), "RESTART", "warning", decision.text))
        self.query_one(RuntimeStatus).show_restarting(decision.text)  # the stepper keeps the failure and its advice
        assert decision.delay_s is not None
        self.restart_timer = self.set_timer(decision.delay_s, self.action_restart)

    def _warn(self, text: str) -> None:
        self._log(TaggedLine(self.clock(), "WARNING", "warning", text))

    # -- view helpers -----------------------------------------------------------------------
    def _show_step(self) -> None:
        tracker = self.tracker
        self.query_one(Stepper).show(tracker.step, tracker.failure, tracker.status)
        self.query_one(JoinPanel).follow(tracker.step)
        self._show_preflight()

    def _show_preflight(self) -> None:
        """The preflight view replaces the dashboard before authorization (or when p asks for it)."""
        tracker = self.tracker
        state = tracker.preflight
        if tracker.in_preflight != self._was_in_preflight:  # authorized (or restarted): back to the automatic choice
            self._was_in_preflight, self.preflight_choice = tracker.in_preflight, None
        shown = tracker.in_preflight if self.preflight_choice is None else self.preflight_choice
        self.set_class(shown, "-preflight")
        self.set_class(state.unreachable, "-unreachable")
        self.query_one(PreflightPanel).show(state, stopped=self.runtime_stopped)
        self.query_one(ReachabilityPanel).show(state)
        self._place_log()
        binding_state = (state.seen, state.unreachable)
        if binding_state != self._binding_state:
            self._binding_state = binding_state
            self.refresh_bindings()

    def _log(self, line: TaggedLine) -> None:
        self.query_one(LogPane).add(line)

    @property
    def runtime_running(self) -> bool:
        return self.process is not None and self.process.running

    # -- actions ----------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "restart":
            return not self.runtime_running and not self.quitting and self.process is not None
        if action == "retry":  # r while the swarm cannot reach the worker: dial again now
            return self.runtime_running and self.tracker.unreachable and not self.quitting
        if action == "toggle_preflight":
            return self.tracker.preflight.seen
        if action == "toggle_pause":
            return self.runtime_running and not self.quitting and self.pause_control is not None
        return True

    async def action_quit(self) -> None:
        self._quit(None)

    async def action_interrupt(self) -> None:
        self._quit(signal.SIGINT)

    def _quit(self, stop_signal: int | None) -> None:
        if self.quitting:  # asked again while stopping: the runtime exits at once
            if self.process is not None:
                self.process.hurry()
            return
        self.quitting = True
        self._cancel_restart()
        self.tracker.status = "Stopping: finishing the current request and leaving the averaging group..."
        self._show_step()
        runtime_code = EXIT_OK if self.runtime_running or self.ended_code is None else self.ended_code
        self.stop_and_exit(client_exit_code(runtime_code, stop_signal, self.rejected))

    @work(group="stop", exclusive=True)
    async def stop_and_exit(self, code: int) -> None:
        if self.process is not None:
            await self.process.stop()
        if self.event_log:
            self.event_log.close()
        self.exit(code, return_code=code)

    def action_retry(self) -> None:
        if not self.check_action("retry", ()) or self.process is None:
            return
        self.process.retry_now()  # SIGUSR1: the runtime stops waiting and asks to join again
        self.tracker.retry_now()
        self._show_step()

    def action_toggle_pause(self) -> None:
        if self.check_action("toggle_pause", ()):
            self.send_pause()

    @work(thread=True, group="pause", exclusive=True)
    def send_pause(self) -> None:
        assert self.pause_control is not None
        self.notify(self.pause_control(), title="Pause")  # the yield events that follow show the state

    def action_toggle_preflight(self) -> None:
        self.preflight_choice = not self.has_class("-preflight")
        self._show_preflight()

    def action_restart(self) -> None:
        self._cancel_restart()  # r during a restart's wait starts it now
        if self.runtime_running or self.quitting:
            return
        self.tracker.restarted()
        self.runtime_stopped = False
        self.last_error = self.last_exit = self.ended_code = None
        self.rejected = False
        self.stderr_tail.clear()
        self.query_one(RuntimeStatus).hide()
        self._show_step()
        self.supervise()

    def _cancel_restart(self) -> None:
        if self.restart_timer is not None:
            self.restart_timer.stop()
            self.restart_timer = None

    def action_toggle_logs(self) -> None:
        """Below 30 rows (and from the Log tab) the Log tab opens or closes; otherwise the pane under the tabs."""
        dashboard = self.query_one(Dashboard)
        if dashboard.active == LOG_TAB:
            dashboard.active = self.tab_before_log
        elif self.has_class("-short") and not self.has_class("-preflight"):
            self.tab_before_log, dashboard.active = dashboard.active, LOG_TAB
        else:
            self.log_choice = not self.query_one(LogPane).display
        self._place_log()

    def action_show_tab(self, tab: str) -> None:
        if tab == LOG_TAB and self.query_one(Dashboard).active != LOG_TAB:
            self.tab_before_log = self.query_one(Dashboard).active
        self.query_one(Dashboard).active = tab

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._place_log()

    def _place_log(self) -> None:
        """The log fills the Log tab; elsewhere it shows under the tabs from 30 rows, and under the preflight checks
        unless the diagnosis needs the rows of a short terminal; `l` overrides that choice."""
        if not self.is_mounted:
            return
        in_tab = self.query_one(Dashboard).active == LOG_TAB and not self.has_class("-preflight")
        self.set_class(in_tab, "-log-tab")
        if in_tab:
            shown = True
        elif self.log_choice is not None:
            shown = self.log_choice
        elif self.has_class("-preflight"):
            shown = not (self.has_class("-short") and self.has_class("-unreachable"))
        else:
            shown = not self.has_class("-short")
        self.query_one(LogPane).display = shown

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_export_bundle(self) -> None:
        if self.bundle is None:
            self.notify("No config dir is known, so no bundle can be written here.", severity="warning")
            return
        self.notify("Writing the support bundle...")
        self.export_bundle(self.query_one(LogPane).plain_lines())

    @work(thread=True, group="bundle", exclusive=True)
    def export_bundle(self, recent: list[str]) -> None:
        target = self.bundle
        assert target is not None
        try:
            path = build_bundle(
                target.output_dir,
                config_dir=target.config_dir,
                logs_dir=target.logs_dir,
                secrets=target.secrets,
                extra_lines=recent,
            )
        except OSError as error:
            self.notify(f"Could not write the support bundle: {error}", severity="error", timeout=15)
            return
        self.last_bundle = path
        self.notify(f"Support bundle written to {path}. {REVIEW_NOTE}", title="Support bundle", timeout=20)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand(
            "Export support bundle", "Write a zip of logs, config and system report", self.action_export_bundle
        )
        yield SystemCommand("Toggle logs", "Show or hide the log pane", self.action_toggle_logs)
        yield SystemCommand("Help", "What the panels and keys mean", self.action_help)
        if self.check_action("toggle_preflight", ()):
            yield SystemCommand("Toggle preflight", "Show or hide the preflight checks", self.action_toggle_preflight)
        if self.check_action("retry", ()):
            yield SystemCommand(
                "Retry the join now", "Ask the swarm to connect back to this worker now", self.action_retry
            )
        if self.check_action("toggle_pause", ()):
            yield SystemCommand("Pause or resume", "Pause contributing, or resume it (space)", self.action_toggle_pause)
        if self.check_action("restart", ()):
            yield SystemCommand("Restart worker", "Start the stopped worker runtime again", self.action_restart)
