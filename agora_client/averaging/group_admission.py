"""Tickets in SPARTA averaging: only workers of this stage, holding a ticket the auth service signed, average with us.

Each worker puts its own ticket into the data hivemind gathers from every peer at matchmaking. A leader
refuses a join request whose ticket does not name the requesting peer, before that peer is in any group.
Once a group is assembled, every member checks every other member's ticket: a group that a stranger led
is refused by all honest members alike, since they all see the same gathered data. libp2p authenticates
peer ids, so a ticket copied from another worker's gathered data is worthless to the copier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agora_client.auth.ticket_source import TicketSource
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.ticket_gate import TicketGate, TicketRejected


@dataclass
class GroupAdmission:
    gate: TicketGate  # roles=("worker",), stage=this worker's stage
    tickets: TicketSource | None  # this worker's own ticket (None: it has none to show and will be refused)
    rejections: RejectionLog  # counted and logged by this worker's main process (the averager is forked)

    def credentials(self, peer_id: str) -> dict[str, str]:
        """What this worker adds to the data gathered at matchmaking."""
        return {"ticket": self.tickets.ticket_for(peer_id) if self.tickets is not None else ""}

    def refusal(self, peer_id: str, gathered: Any, context: str = "SPARTA averaging") -> str | None:
        """Why the peer that gathered ``gathered`` may not average with us, or make the call ``context`` names
        (None: it may); refusals are reported."""
        ticket = gathered.get("ticket") if isinstance(gathered, dict) else None
        try:
            self.gate.check(ticket.encode("ascii", "replace") if isinstance(ticket, str) else b"", peer_id)
        except TicketRejected as error:
            self.rejections.report(peer_id, error.reason, f"{context}: {error}")
            return f"{error.reason}: {error}"
        return None
