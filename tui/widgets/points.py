"""Points: presence and compute, the rate per hour, and the confirmed total when known."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import PointsEvent


class PointsPanel(Widget):
    points: reactive[PointsEvent | None] = reactive(None, layout=True)
    """The latest points event."""

    def on_mount(self) -> None:
        self.border_title = "Points"

    def show(self, event: PointsEvent) -> None:
        self.points = event

    def render(self) -> str:
        points = self.points
        if points is None:
            return "[$text-muted]presence points start in sync phase 1[/]"
        confirmed = f"{points.confirmed:.1f}" if points.confirmed is not None else "[$text-muted]pending[/]"
        return (
            f"presence [b]{points.presence:.1f}[/] · compute [b]{points.compute:.1f}[/]\n"
            f"rate [b]{points.rate_per_hour:.1f}[/] per hour\nconfirmed {confirmed}"
        )
