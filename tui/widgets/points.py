"""Points: the local estimate (presence + compute), its rate, the monitor's confirmed total and rank."""

from __future__ import annotations

from agora_client.events import PointsEvent
from tui.widgets.chart_panel import ChartPanel
from tui.widgets.format import points_text


class PointsPanel(ChartPanel):
    TITLE = "Points"
    EMPTY = "presence points start in sync phase 1"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.points: PointsEvent | None = None

    def show(self, event: PointsEvent) -> None:
        self.points = event
        local = event.presence + event.compute
        self.push("chart", local)
        confirmed = points_text(event.confirmed) if event.confirmed is not None else "[$text-muted]pending[/]"
        rank = f" · rank [b]#{event.rank}[/] of {event.ranked}" if event.rank is not None else ""
        self.describe(
            f"local [b]{points_text(local)}[/] · +{points_text(event.rate_per_hour)}/h\n"
            f"confirmed [b]{confirmed}[/]{rank}\n"
            f"[$text-muted]presence {points_text(event.presence)} · compute {points_text(event.compute)}[/]"
        )
