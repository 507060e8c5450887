"""Who this worker is in the swarm: identity, slot, stage, short peer id, stage occupancy."""

from __future__ import annotations

from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import AuthEvent, StageEvent
from agora_client.frontend.lines import short_peer_id


class IdentityPanel(Widget):
    identity: reactive[str] = reactive("", layout=True)
    """Hugging Face identity the slot is bound to."""
    slot: reactive[int | None] = reactive(None, layout=True)
    stage: reactive[str] = reactive("", layout=True)
    peer_id: reactive[str] = reactive("", layout=True)
    occupancy: reactive[dict[str, int]] = reactive(dict, layout=True)
    """Workers per stage, when the runtime knows it."""

    def on_mount(self) -> None:
        self.border_title = "Identity"

    def show_auth(self, event: AuthEvent) -> None:
        if event.identity:
            self.identity = event.identity
        if event.slot is not None:
            self.slot = event.slot
        if event.stage:
            self.stage = event.stage
        if event.peer_id:
            self.peer_id = event.peer_id

    def show_stage(self, event: StageEvent) -> None:
        self.stage = event.stage
        if event.peer_id:
            self.peer_id = event.peer_id
        if event.occupancy:
            self.occupancy = dict(event.occupancy)

    def render(self) -> str:
        if not self.identity and not self.stage:
            return "[$text-muted]not authorized yet[/]"
        slot = f" · slot {self.slot}" if self.slot is not None else ""
        peer = f" · peer {escape(short_peer_id(self.peer_id))}" if self.peer_id else ""
        lines = [f"[b]{escape(self.identity or '?')}[/]{slot}", f"stage [b]{escape(self.stage or '?')}[/]{peer}"]
        if self.occupancy:
            cells = " · ".join(
                f"[b]{escape(stage)} {count}[/]" if stage == self.stage else f"{escape(stage)} {count}"
                for stage, count in self.occupancy.items()
            )
            lines.append(f"[$text-muted]occupancy[/] {cells}")
        return "\n".join(lines)
