"""Sync phases: steps done of total and the target local epoch."""

from __future__ import annotations

from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import SyncEvent

_PHASES = {"sync1": "Sync 1 · weights", "sync2": "Sync 2 · optimizer", "active": "Active"}


class SyncPanel(Widget):
    sync: reactive[SyncEvent | None] = reactive(None, layout=True)
    """The latest sync event."""

    def show(self, event: SyncEvent) -> None:
        self.sync = event

    def render(self) -> str:
        sync = self.sync
        if sync is None:
            return "[$text-muted]not syncing yet[/]"
        if sync.phase == "active":
            return f"[$text-success]✔ in sync[/] since local epoch [b]{sync.local_epoch}[/]\nfully contributing to training"
        done = sync.steps_total - sync.steps_left
        target = f"\ntarget local epoch [b]{sync.target_epoch}[/]" if sync.target_epoch is not None else ""
        return f"[b]{_PHASES[sync.phase]}[/]\nstep [b]{done}[/] of {sync.steps_total} (local epoch {sync.local_epoch}){target}"
