"""How the swarm is learning: its loss and its held-out eval loss over time, from the trainers' progress records."""

from __future__ import annotations

from agora_client.events import SwarmEvent
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel


def trend(history: list[tuple[float, float]], unit: str) -> str:
    """``↓ 0.123 over 8 <unit>`` from a history's first and last values; empty below two points."""
    if len(history) < 2:
        return ""
    change = history[-1][1] - history[0][1]
    arrow = "[$text-success]↓[/]" if change < 0 else "[$text-warning]↑[/]"
    return f"{arrow} {abs(change):.3f} over {len(history)} {unit}"


class LossPanel(ChartPanel):
    TITLE = "Swarm loss"
    EMPTY = "waiting for the trainers' first progress report"
    Y_LABEL = "loss"
    SERIES = {"loss": Series("loss", "primary"), "eval": Series("eval", "warning")}
    ZERO_BASED = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.last: SwarmEvent | None = None

    def show(self, event: SwarmEvent) -> None:
        self.last = event
        self.plot("loss", event.loss_history)
        self.plot("eval", event.eval_history)
        self.draw()
        if event.loss is None and event.eval_loss is None:
            self.describe(f"[$text-muted]{event.trainers} trainer(s), no loss reported yet[/]")
            return
        shown = [
            self.key(name, f"{value:.3f}")
            for name, value in (("loss", event.loss), ("eval", event.eval_loss))
            if value is not None
        ]
        # the trend of the held-out eval loss once there is one: the better sign of learning
        change = (
            trend(event.eval_history, "evals") if event.eval_loss is not None else trend(event.loss_history, "reports")
        )
        self.describe(f"{' · '.join(shown)}\n[$text-muted]{change or 'no trend yet'} · {event.trainers} trainer(s)[/]")
