"""Training: local epoch, forward / backward batches per minute, loss."""

from __future__ import annotations

from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import StepEvent


class TrainingPanel(Widget):
    step: reactive[StepEvent | None] = reactive(None, layout=True)
    """The latest step event."""

    def on_mount(self) -> None:
        self.border_title = "Training"

    def show(self, event: StepEvent) -> None:
        self.step = event

    def render(self) -> str:
        step = self.step
        if step is None:
            return "[$text-muted]no batches yet[/]"
        loss = f"{step.loss:.4f}" if step.loss is not None else "[$text-muted]unknown[/]"
        return (
            f"local epoch [b]{step.local_epoch}[/] · stage {escape(step.stage)}\n"
            f"forward [b]{step.forward_per_min:.0f}[/]/min · backward [b]{step.backward_per_min:.0f}[/]/min\n"
            f"loss [b]{loss}[/]"
        )
