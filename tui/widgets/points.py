"""Points: the local estimate (presence + compute), its rate, the monitor's confirmed total and rank, its verified
compute beside the claimed, over time."""

from __future__ import annotations

from rich.markup import escape

from agora_client.events import EnergyEvent, PointsEvent
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
        self.energy: EnergyEvent | None = None

    def show_energy(self, event: EnergyEvent) -> None:
        """Energy used while serving and points per kWh, below the points (once there are some)."""
        self.energy = event
        if self.points is not None:
            self.show(self.points)

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
            f"[$text-muted]presence {points_text(event.presence)} · compute {points_text(event.compute)}[/]\n"
            f"{self.key('confirmed', confirmed)}{rank}"
            + verified_markup(event)
            + energy_markup(self.energy)
            + (f"\n[$text-muted]{escape(event.page_url)}[/]" if event.page_url else "")
        )
        self.draw()


def verified_markup(event: PointsEvent) -> str:
    """The monitor's line on compute: verified (receipted by trainers) of claimed, in warning colour when the claim
    exceeds the trainers' receipts; nothing before the monitor has said."""
    if event.verified_compute is None or event.claimed_compute is None:
        return ""
    figures = (
        f"compute [b]{points_text(event.verified_compute)}[/b] verified of {points_text(event.claimed_compute)} claimed"
    )
    if event.flagged:
        return f"\n[$text-warning]{figures}: the claim exceeds the trainers' receipts[/]"
    return f"\n{figures}"


def energy_markup(event: EnergyEvent | None) -> str:
    """The GPU's energy while serving and the points it earned per kWh; nothing where the card does not report it."""
    if event is None or event.kwh is None:
        return ""
    per_kwh = f" · [b]{points_text(event.points_per_kwh)}[/b] points/kWh" if event.points_per_kwh is not None else ""
    return f"\n[$text-muted]energy {event.kwh:.3f} kWh[/]{per_kwh}"
