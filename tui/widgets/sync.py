"""Sync phases: steps done of total and the target local epoch, following the training epochs."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import StepEvent, SyncEvent

_PHASES = {"sync1": "Sync 1 · weights", "sync2": "Sync 2 · optimizer", "active": "Active"}


class SyncPanel(Widget):
    sync: reactive[SyncEvent | None] = reactive(None, layout=True)
    """The latest sync event."""
    local_epoch: reactive[int | None] = reactive(None, layout=True)
    """The newest local epoch (step events come every epoch, sync events only at phase changes)."""

    def show(self, event: SyncEvent) -> None:
        self.sync = event
        self.local_epoch = max(event.local_epoch, self.local_epoch or 0)

    def follow(self, event: StepEvent) -> None:
        self.local_epoch = event.local_epoch

    def render(self) -> str:
        sync = self.sync
        if sync is None:
            return "[$text-muted]not syncing yet[/]"
        epoch = self.local_epoch if self.local_epoch is not None else sync.local_epoch
        if sync.phase == "active":
            return (
                f"[$text-success]✔ in sync[/] since local epoch [b]{sync.local_epoch}[/]\n"
                "fully contributing to training"
            )
        if sync.target_epoch is None:
            return f"[b]{_PHASES[sync.phase]}[/]\nlocal epoch {epoch}"
        start = sync.target_epoch - sync.steps_total
        done = min(sync.steps_total, max(0, epoch - start))
        return (
            f"[b]{_PHASES[sync.phase]}[/]\nstep [b]{done}[/] of {sync.steps_total} (local epoch {epoch})\n"
            f"target local epoch [b]{sync.target_epoch}[/]"
        )
