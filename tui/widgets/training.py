"""Training: the requests this node serves per minute (forward and backward), its local epoch and loss
(the tail's own, when it is the tail)."""

from __future__ import annotations

from agora_client.events import StepEvent, TrafficEvent
from tui.widgets.chart_panel import ChartPanel


class TrainingPanel(ChartPanel):
    TITLE = "Requests served"
    EMPTY = "no requests yet: trainers send batches from sync phase 2 on"
    CHARTS = {"forward": "fwd", "backward": "bwd"}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.step: StepEvent | None = None
        self.traffic: TrafficEvent | None = None

    def show(self, event: StepEvent) -> None:
        self.step = event
        self._describe()

    def show_traffic(self, event: TrafficEvent) -> None:
        self.traffic = event
        self.push("forward", event.forward_per_min)
        self.push("backward", event.backward_per_min)
        self._describe()

    def _describe(self) -> None:
        lines = []
        if self.traffic is not None:
            traffic = self.traffic
            lines.append(f"forward [b]{traffic.forward_per_min:.0f}[/]/min · backward [b]{traffic.backward_per_min:.0f}[/]/min")
        details = []
        if self.step is not None:
            details.append(f"epoch {self.step.local_epoch}")
            if self.step.loss is not None:
                details.append(f"loss {self.step.loss:.4f}")
        if self.traffic is not None:
            details.append(f"{self.traffic.forward_total + self.traffic.backward_total:,} served")
        if details:
            lines.append(f"[$text-muted]{' · '.join(details)}[/]")
        if lines:
            self.describe("\n".join(lines))
