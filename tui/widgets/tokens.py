"""The whole swarm's throughput: tokens per second over all trainers, over time."""

from __future__ import annotations

from agora_client.events import SwarmEvent
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel


class TokensPanel(ChartPanel):
    TITLE = "Swarm throughput"
    EMPTY = "waiting for the trainers' first progress report"
    Y_LABEL = "tokens/s"
    SERIES = {"tokens": Series("tokens/s", "primary")}

    def show(self, event: SwarmEvent) -> None:
        self.push("tokens", event.ts, event.tokens_per_s)
        self.describe(f"{self.key('tokens', f'{event.tokens_per_s:,.0f}')} over {event.trainers} trainer(s)")
        self.draw()
