"""Preflight: each check the runtime makes before authorizing, with pass / warn / fail and the reason."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.widgets import Static

from agora_client.events import PREFLIGHT_CHECKS, PreflightEvent
from tui.state import CHECK_LABELS, PreflightState

MARKS = {"pass": "✔", "warn": "▲", "fail": "✖", "checking": "◌", "waiting": "○"}
_MARK_STYLE = {
    "pass": "$text-success",
    "warn": "$text-warning",
    "fail": "$text-error",
    "checking": "$text-accent",
    "waiting": "$text-muted",
}
_REASON_STYLE = {"pass": "$text-muted", "warn": "$text-warning", "fail": "$text-error"}


def _result_text(result: PreflightEvent) -> str:
    value = escape(result.value) if result.value else f"[$text-muted]{result.status}[/]"
    if not result.reason:
        return value
    return f"{value} [$text-muted]—[/] [{_REASON_STYLE[result.status]}]{escape(result.reason)}[/]"


def _pending_text(check: str, state: PreflightState, stopped: bool) -> tuple[str, str]:
    """(status class, text) for a check without a result yet."""
    if check == "reachability":
        reachability = state.reachability
        if reachability is not None and reachability.status == "checking":
            where = escape(reachability.address or f"port {reachability.port}")
            return "checking", f"the swarm is connecting back to this worker ({where})..."
        if stopped:
            return "waiting", "[$text-muted]not tested: the worker stopped before joining[/]"
        return "waiting", "[$text-muted]tested by the swarm when this worker asks to join[/]"
    if stopped:
        return "waiting", "[$text-muted]not run: the worker stopped[/]"
    if check == state.checking:
        return "checking", "checking..."
    return "waiting", "[$text-muted]waiting[/]"


class PreflightPanel(Vertical):
    """One row per check: a mark, the check's name, what was measured and why it passed, warned or failed."""

    def compose(self) -> ComposeResult:
        for check in PREFLIGHT_CHECKS:
            with Horizontal(id=f"check-{check}", classes="check-row -waiting"):
                yield Static(classes="check-label")
                yield Static(classes="check-text")

    def on_mount(self) -> None:
        self.border_title = "Preflight"
        self.show(PreflightState())

    def show(self, state: PreflightState, stopped: bool = False) -> None:
        """Redraw from the preflight state; ``stopped``: the runtime ended, so nothing pending will come."""
        for check in PREFLIGHT_CHECKS:
            result = state.results.get(check)
            if result is not None:
                status, text = result.status, _result_text(result)
            else:
                status, text = _pending_text(check, state, stopped)
            row = self.query_one(f"#check-{check}", Horizontal)
            for name in MARKS:
                row.set_class(name == status, f"-{name}")
            row.query_one(".check-label", Static).update(
                f"[{_MARK_STYLE[status]}]{MARKS[status]}[/] {CHECK_LABELS[check]}"
            )
            row.query_one(".check-text", Static).update(text)
        counts = state.counts()
        parts = [f"[$text-success]{counts['pass']} passed[/]"]
        if counts["warn"]:
            parts.append(f"[$text-warning]{counts['warn']} warning{'s' if counts['warn'] > 1 else ''}[/]")
        if counts["fail"]:
            parts.append(f"[$text-error]{counts['fail']} failed[/]")
        self.border_subtitle = " · ".join(parts) if state.results else ""
