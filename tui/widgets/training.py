"""Training: the requests this node serves per minute (forward and backward) over time, its local epoch and
loss (the tail's own, when it is the tail)."""

from __future__ import annotations

from agora_client.events import StepEvent, TrafficEvent
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel


class TrainingPanel(ChartPanel):
    TITLE = "Requests served"
    EMPTY = "no requests yet: trainers send batches from sync phase 2 on"
    Y_LABEL = "req/min"
    SERIES = {"forward": Series("fwd", "primary"), "backward": Series("bwd", "accent")}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.step: StepEvent | None = None
        self.traffic: TrafficEvent | None = None

    def show(self, event: StepEvent) -> None:
        self.step = event
        self._describe()

    def show_traffic(self, event: TrafficEvent) -> None:
        self.traffic = event
        self.push("forward", event.ts, event.forward_per_min)
        self.push("backward", event.ts, event.backward_per_min)
        self._describe()
        self.draw()

    def _describe(self) -> None:
        lines = []
        if self.traffic is not None:
            traffic = self.traffic
            forward, backward = f"{traffic.forward_per_min:.0f}", f"{traffic.backward_per_min:.0f}"
            lines.append(f"{self.key('forward', forward + '/min')} · {self.key('backward', backward + '/min')}")
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
