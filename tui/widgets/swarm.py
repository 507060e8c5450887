"""How the swarm is learning: its loss over time, from the trainers' progress records."""

from __future__ import annotations

from agora_client.events import SwarmEvent
from tui.widgets.chart_panel import ChartPanel


class SwarmPanel(ChartPanel):
    TITLE = "Swarm loss"
    EMPTY = "waiting for the trainers' first progress report"

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.last: SwarmEvent | None = None

    def show(self, event: SwarmEvent) -> None:
        self.last = event
        if event.loss_history:
            self.plot("chart", [loss for _, loss in event.loss_history])
        if event.loss is None:
            self.describe(f"[$text-muted]{event.trainers} trainer(s), no loss reported yet[/]")
            return
        history = [loss for _, loss in event.loss_history]
        trend = ""
        if len(history) >= 2:
            change = history[-1] - history[0]
            arrow = "[$text-success]↓[/]" if change < 0 else "[$text-warning]↑[/]"
            trend = f" {arrow} {abs(change):.3f} since {len(history)} reports ago"
        self.describe(
            f"loss [b]{event.loss:.4f}[/]{trend}\n"
            f"[$text-muted]{event.trainers} trainer(s) · {event.tokens_per_s:,.0f} tokens/s[/]"
        )
