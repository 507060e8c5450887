"""Shown when the runtime has stopped: its exit code and last output, or when it starts again; a restart button."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.markup import escape
from textual.widgets import Button, Static


class RuntimeStatus(Horizontal):
    def compose(self) -> ComposeResult:
        yield Static(id="runtime-status-detail")
        yield Button("Restart (r)", id="restart-button", variant="warning", compact=True, action="app.restart")

    def show_stopped(self, code: int | None, detail: str) -> None:
        """The stepper holds the reason and advice; this line says the process is gone and how."""
        how = "could not start" if code is None else f"exited with code {code}"
        more = f" [$text-muted]· {escape(detail)}[/]" if detail else ""
        self.query_one("#runtime-status-detail", Static).update(f"[$text-error b]The worker runtime {how}[/]{more}")
        self.display = True

    def show_restarting(self, text: str) -> None:
        """--restart on-failure: the runtime crashed and starts again by itself (r: now)."""
        self.query_one("#runtime-status-detail", Static).update(f"[$text-warning b]{escape(text)}[/]")
        self.display = True

    def hide(self) -> None:
        self.display = False
