"""This node's share of its stage's work: samples it processed of all its stage processed, per epoch, over time."""

from __future__ import annotations

from collections import deque

from textual.markup import escape

from agora_client.events import StageEvent, StepEvent
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel

SMOOTHING = 10  # epochs in the moving mean


class SharePanel(ChartPanel):
    TITLE = "Share of the stage"
    EMPTY = "known after the first stage epoch with batches"
    Y_LABEL = "% of stage"
    SERIES = {"share": Series("share", "primary")}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.share: float | None = None
        self.stage = ""
        self.stage_workers: int | None = None
        self._recent: deque[float] = deque(maxlen=SMOOTHING)

    def show(self, event: StepEvent) -> None:
        if event.stage_share is None:
            return
        self._recent.append(event.stage_share)
        # Small swarms step every second or two, so one epoch's share jumps between 0 and 1: show a moving mean.
        self.share, self.stage = sum(self._recent) / len(self._recent), event.stage
        self.push("share", event.ts, self.share * 100)
        self._describe()
        self.draw()

    def show_stage(self, event: StageEvent) -> None:
        self.stage = event.stage
        self.stage_workers = event.occupancy.get(event.stage, self.stage_workers)
        self._describe()

    def _describe(self) -> None:
        if self.share is None:
            return
        fair = f" · fair share {1 / self.stage_workers:.0%} of {self.stage_workers}" if self.stage_workers else ""
        share = self.key("share", f"{self.share:.0%}")
        self.describe(
            f"{share} of {escape(self.stage)}'s samples (last {len(self._recent)} epochs)\n"
            f"[$text-muted]{fair.lstrip(' ·')}[/]"
        )
