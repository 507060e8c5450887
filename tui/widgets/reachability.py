"""Reachability diagnosis: the swarm could not connect back to this worker. Which port, tested from
where, what to open, and when the next attempt comes (``r`` retries at once)."""

from __future__ import annotations

from typing import Callable

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.widgets import Static

from agora_client.events import ReachabilityEvent
from agora_client.frontend.lines import human_duration, network_summary
from tui.state import PreflightState

# The dial-back's error codes (agora_client.auth.reachability.dial_back), in words.
RESULTS = {
    "timeout": "no answer (timeout): a firewall or a NAT dropped the connection",
    "refused": "refused: the address answered, but nothing accepts connections on that port",
    "unroutable": "no route from the swarm to that address",
}


TITLE = "Not reachable: the swarm cannot connect to this worker"


def _row(label: str, name: str) -> Horizontal:
    return Horizontal(
        Static(label, classes="reach-label"), Static(id=f"reach-{name}", classes="reach-text"), classes="reach-row"
    )


class ReachabilityPanel(Vertical):
    """Shown while the swarm cannot reach this worker; the runtime retries on its own, or at once on ``r``."""

    def __init__(self, clock: Callable[[], float], **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.clock = clock  # the app's clock: tests fix it, so the countdown is the same on every run
        self.state = PreflightState()
        self._advice: list[str] = []  # the advice lines on screen
        self._diagnosis: ReachabilityEvent | None = None
        self._next_attempt: float | None = None  # on the app's clock: from when the diagnosis arrived, not its ts

    def compose(self) -> ComposeResult:
        yield _row("Port", "port")
        yield _row("Tested from", "from")
        yield _row("Result", "result")
        yield Static("[b]What to do[/]", id="reach-advice-title")
        yield Vertical(id="reach-advice")
        yield Static(id="reach-retry")

    def on_mount(self) -> None:
        self.border_title = TITLE
        self.set_interval(1.0, self._show_retry)

    def show(self, state: PreflightState) -> None:
        diagnosis = state.diagnosis
        self.state = state
        if diagnosis is None:
            return
        if diagnosis is not self._diagnosis:
            self._diagnosis = diagnosis
            retry = diagnosis.retry_in_s
            self._next_attempt = None if retry is None else self.clock() + retry
            self._show_diagnosis(diagnosis)
            self.border_title = TITLE if state.failed_dials < 2 else f"{TITLE} (attempt {state.failed_dials})"
        self._show_retry()

    def _show_diagnosis(self, diagnosis: ReachabilityEvent) -> None:
        port = f"TCP {diagnosis.port}" if diagnosis.port is not None else "unknown"
        announced = f" [$text-muted]· dialed at[/] {escape(diagnosis.address)}" if diagnosis.address else ""
        self.query_one("#reach-port", Static).update(f"[b]{port}[/]{announced}")
        self.query_one("#reach-from", Static).update(escape(diagnosis.tested_from or "unknown"))
        result = RESULTS.get(diagnosis.error, diagnosis.error or "the connection failed")
        network = f"\n{escape(network_summary(diagnosis.network))}" if diagnosis.network is not None else ""
        self.query_one("#reach-result", Static).update(f"[$text-error]{escape(result)}[/]{network}")
        advice = list(
            diagnosis.advice[1:] if len(diagnosis.advice) > 1 else diagnosis.advice
        )  # [0] restates the rows above
        if advice != self._advice:
            self._advice = advice
            box = self.query_one("#reach-advice", Vertical)
            box.remove_children()
            box.mount_all(
                Horizontal(
                    Static("•", classes="advice-bullet"),
                    Static(escape(text), classes="advice-text"),
                    classes="advice-row",
                )
                for text in advice
            )

    def _show_retry(self) -> None:
        state = self.state
        diagnosis = state.diagnosis
        if diagnosis is None:
            return
        reachability = state.reachability
        if reachability is not None and reachability.status == "checking":
            text = "[$text-accent]Retrying: the swarm is connecting back to this worker...[/]"
        elif state.retry_requested:
            text = "[$text-accent]Retrying now...[/]"
        elif diagnosis.trying_relay:
            text = "[$text-accent]Not reachable directly: trying the run's relay now...[/]"
        elif self._next_attempt is not None:
            left = max(0.0, self._next_attempt - self.clock())
            text = (
                f"Not joining while unreachable · next attempt in [b]{human_duration(left)}[/] · press [b]r[/] "
                "to retry now"
            )
        else:
            text = "Not joining while unreachable · press [b]r[/] to retry now"
        self.query_one("#reach-retry", Static).update(text)
