"""How the swarm is learning: its loss over time and its newest held-out eval loss, from the trainers'
progress records."""

from __future__ import annotations

from agora_client.events import SwarmEvent
from tui.widgets.chart_panel import ChartPanel


def trend(history: list[tuple[float, float]], unit: str) -> str:
    """`` ↓ 0.123 over 8 <unit>`` from a history's first and last values; empty below two points."""
    if len(history) < 2:
        return ""
    change = history[-1][1] - history[0][1]
    arrow = "[$text-success]↓[/]" if change < 0 else "[$text-warning]↑[/]"
    return f" {arrow} {abs(change):.3f} over {len(history)} {unit}"


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
        if event.loss is None and event.eval_loss is None:
            self.describe(f"[$text-muted]{event.trainers} trainer(s), no loss reported yet[/]")
            return
        self.describe(f"{self.figures(event)}\n[$text-muted]{event.trainers} trainer(s) · {event.tokens_per_s:,.0f} tokens/s[/]")

    @staticmethod
    def figures(event: SwarmEvent) -> str:
        """The newest loss and eval loss; the trend follows the last figure shown (held-out eval is the better
        sign of learning, so it is the eval loss's once there is one)."""
        shown = [f"loss [b]{event.loss:.4f}[/]"] if event.loss is not None else []
        if event.eval_loss is None:
            return shown[0] + trend(event.loss_history, "reports")
        shown.append(f"eval [b]{event.eval_loss:.4f}[/]")
        return " · ".join(shown) + trend(event.eval_history, "evals")
