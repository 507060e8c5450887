"""The panel for the current join step: the download, the queue or the sync phase."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import ContentSwitcher

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
        self.current, self.border_title = _PANEL_FOR_STEP[step]
