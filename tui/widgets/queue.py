"""The join queue: position and estimated wait."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import QueueEvent
from agora_client.frontend.lines import human_duration


class QueuePanel(Widget):
    position: reactive[int | None] = reactive(None, layout=True)
    """Place in the join queue (1 = next); 0 once admitted."""
    wait_s: reactive[float | None] = reactive(None, layout=True)
    """Estimated wait, as the auth service computed it."""

    def show(self, event: QueueEvent) -> None:
        self.position, self.wait_s = event.position, event.estimated_wait_s

    def render(self) -> str:
        if self.position is None:
            return "[$text-muted]not in the queue[/]"
        if self.position == 0:
            return "[$text-success]✔ admitted[/]: no wait in the join queue"
        return (
            f"position [b]{self.position}[/]\nestimated wait [b]{human_duration(self.wait_s)}[/]\n"
            "[$text-muted]joins are paced; the snapshot is kept[/]"
        )
