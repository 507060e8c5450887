"""The status band: every mission figure in two rows that show at any size (authorization, download, queue,
sync, GPU memory, SPARTA rounds ok/total, points, the swarm's loss), above the tabs."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid
from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import (
    AuthEvent,
    DownloadEvent,
    Event,
    PointsEvent,
    QueueEvent,
    ResourcesEvent,
    SpartaEvent,
    StepEvent,
    SwarmEvent,
    SyncEvent,
    YieldEvent,
)
from tui.widgets.figures import (
    WAITING,
    Figure,
    SpartaTally,
    auth_figure,
    download_figure,
    gpu_figure,
    loss_figure,
    points_figure,
    queue_figure,
    sparta_figure,
    sync_figure,
    yield_figure,
)

CELLS = {
    "auth": "Auth",
    "download": "Download",
    "queue": "Queue",
    "sync": "Sync",
    "gpu": "GPU",
    "sparta": "SPARTA",
    "points": "Points",
    "loss": "Loss",
}


class FigureCell(Widget):
    """One labelled figure; the long form where the cell is wide enough."""

    figure: reactive[Figure] = reactive(Figure(WAITING))

    def __init__(self, label: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.label = label

    def render(self) -> str:
        room = self.size.width - len(self.label) - 1
        return f"[$text-muted]{self.label}[/] {self.figure.fitting(room)}"


class StatusBand(Grid):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.sparta = SpartaTally()  # every round since the app started, restarts included
        self.queue: QueueEvent | None = None
        self.sync: SyncEvent | None = None
        self.epoch: int | None = None
        self.yielding: YieldEvent | None = None  # the GPU cell says so while the worker yields the GPU

    def compose(self) -> ComposeResult:
        for name, label in CELLS.items():
            yield FigureCell(label, id=f"band-{name}")

    def _set(self, name: str, figure: Figure) -> None:
        self.query_one(f"#band-{name}", FigureCell).figure = figure

    def show(self, event: Event) -> None:
        """Update the figure ``event`` tells (other kinds are ignored)."""
        if isinstance(event, AuthEvent):
            self._set("auth", auth_figure(event))
        elif isinstance(event, DownloadEvent):
            self._set("download", download_figure(event))
        elif isinstance(event, QueueEvent):
            self.queue = event
            self._set("queue", queue_figure(event, admitted=False))
        elif isinstance(event, (SyncEvent, StepEvent)):
            self._show_sync(event)
        elif isinstance(event, YieldEvent):
            self.yielding = None if event.state == "resumed" else event
            self._set("gpu", yield_figure(event) if self.yielding else Figure(WAITING))
        elif isinstance(event, ResourcesEvent):
            self._set("gpu", yield_figure(self.yielding) if self.yielding else gpu_figure(event))
        elif isinstance(event, SpartaEvent):
            self.sparta.add(event)
            self._set("sparta", sparta_figure(self.sparta))
        elif isinstance(event, PointsEvent):
            self._set("points", points_figure(event))
        elif isinstance(event, SwarmEvent):
            self._set("loss", loss_figure(event))

    def _show_sync(self, event: SyncEvent | StepEvent) -> None:
        if isinstance(event, SyncEvent):
            self.sync = event
            self.epoch = max(event.local_epoch, self.epoch or 0)
            self._set("queue", queue_figure(self.queue, admitted=True))  # syncing: past the queue
        else:
            self.epoch = event.local_epoch
        self._set("sync", sync_figure(self.sync, self.epoch))
