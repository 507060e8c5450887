"""Points: the local estimate (presence + compute), its rate, the monitor's confirmed total and rank, over time."""

from __future__ import annotations

from rich.markup import escape

from agora_client.events import PointsEvent
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel
from tui.widgets.format import points_text


class PointsPanel(ChartPanel):
    TITLE = "Points"
    EMPTY = "presence points start in sync phase 1"
    Y_LABEL = "points"
    SERIES = {"local": Series("local", "primary"), "confirmed": Series("confirmed", "success")}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.points: PointsEvent | None = None

    def show(self, event: PointsEvent) -> None:
        self.points = event
        local = event.presence + event.compute
        self.push("local", event.ts, local)
        if event.confirmed is not None:
            self.push("confirmed", event.ts, event.confirmed)
        confirmed = points_text(event.confirmed) if event.confirmed is not None else "[$text-muted]pending[/]"
        rank = f" · rank [b]#{event.rank}[/] of {event.ranked}" if event.rank is not None else ""
        self.describe(
            f"{self.key('local', points_text(local))} +{points_text(event.rate_per_hour)}/h\n"
            f"{self.key('confirmed', confirmed)}{rank}\n"
            f"[$text-muted]presence {points_text(event.presence)} · compute {points_text(event.compute)}[/]"
            + (f"\n[$text-muted]{escape(event.page_url)}[/]" if event.page_url else "")
        )
        self.draw()
