"""Snapshot download: progress bar, rate, ETA and where a resumed download restarted from."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.markup import escape
from textual.reactive import reactive
from textual.widgets import ProgressBar, Static

from agora_client.events import DownloadEvent
from agora_client.frontend.lines import human_bytes, human_duration


class DownloadPanel(Vertical):
    done_bytes: reactive[int] = reactive(0)
    """Bytes on disk so far (bound to the progress bar)."""
    total_bytes: reactive[int | None] = reactive(None)
    """Size of the file being downloaded, when the server says."""

    def compose(self) -> ComposeResult:
        yield ProgressBar(show_eta=False, id="download-bar").data_bind(
            progress=DownloadPanel.done_bytes, total=DownloadPanel.total_bytes
        )
        yield Static("[$text-muted]waiting for authorization[/]", id="download-detail")

    def on_mount(self) -> None:
        # An unknown total would make an animated (indeterminate) bar: show the bar once a size is known.
        self.query_one(ProgressBar).display = False

    def show(self, event: DownloadEvent) -> None:
        if event.total:
            self.total_bytes = event.total
            self.query_one(ProgressBar).display = True
        self.done_bytes = event.bytes
        name = escape(event.file or "snapshot")
        if event.status in ("verified", "done"):
            detail = f"[$text-success]✔[/] {name} {human_bytes(event.bytes)} · {event.status}"
        elif event.status == "failed":
            detail = f"[$text-error]✖ {name}: {escape(event.message or 'failed')}[/]"
        elif event.status == "retry":
            detail = (
                f"[$text-warning]interrupted ({escape(event.message or 'no reason')}), resuming from "
                f"{human_bytes(event.bytes)}[/]"
            )
        else:
            eta = event.eta_s
            if eta is None and event.total and event.rate_bps > 0:
                eta = (event.total - event.bytes) / event.rate_bps
            total = f" / {human_bytes(event.total)}" if event.total else ""
            detail = (
                f"{name}\n"
                f"{human_bytes(event.bytes)}{total} · {human_bytes(event.rate_bps)}/s · ETA {human_duration(eta)}"
            )
            if event.resumed_from:
                detail += f"\n[$text-muted]resumed from {human_bytes(event.resumed_from)}[/]"
        self.query_one("#download-detail", Static).update(detail)
