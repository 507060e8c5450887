"""The panel for the current join step: the download, the queue or the sync phase."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import ContentSwitcher

from agora_client.events import DownloadEvent, QueueEvent, StepEvent, SyncEvent
from tui.state import JoinStep
from tui.widgets.download import DownloadPanel
from tui.widgets.queue import QueuePanel
from tui.widgets.sync import SyncPanel

_PANEL_FOR_STEP = {
    JoinStep.AUTHORIZATION: ("download", "Download"),
    JoinStep.DOWNLOAD: ("download", "Download"),
    JoinStep.QUEUE: ("queue", "Queue"),
    JoinStep.SYNC1: ("sync", "Sync"),
    JoinStep.SYNC2: ("sync", "Sync"),
    JoinStep.ACTIVE: ("sync", "Sync"),
}


class JoinPanel(ContentSwitcher):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(initial="download", **kwargs)

    def compose(self) -> ComposeResult:
        yield DownloadPanel(id="download")
        yield QueuePanel(id="queue")
        yield SyncPanel(id="sync")

    def on_mount(self) -> None:
        self.border_title = "Download"

    def follow(self, step: JoinStep) -> None:
        """Show the step's panel; once active, the join is done and the panel gives its place to the charts."""
        self.current, self.border_title = _PANEL_FOR_STEP[step]
        self.display = step != JoinStep.ACTIVE

    def show(self, event: DownloadEvent | QueueEvent | SyncEvent) -> None:
        if isinstance(event, DownloadEvent):
            self.query_one(DownloadPanel).show(event)
        elif isinstance(event, QueueEvent):
            self.query_one(QueuePanel).show(event)
        else:
            self.query_one(SyncPanel).show(event)

    def follow_epoch(self, event: StepEvent) -> None:
        self.query_one(SyncPanel).follow(event)
