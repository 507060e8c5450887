"""Where a caller's ticket comes from when it presents one on an RPC.

A contributor's worker holds the ticket the auth service gave it (renewed in place). Operator
processes that hold the auth service's signing key (trainers, the workers of a local swarm) issue
their own, one per libp2p peer id they call from, since a ticket is honoured only from the peer it names.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .tickets import issue_ticket, load_signing_key, public_key_text

SELF_ISSUED_TTL_S = 3600.0
RENEW_MARGIN_S = 300.0


class TicketSource(Protocol):
    def ticket_for(self, peer_id: str) -> str:
        """The ticket to present on a call made from ``peer_id``."""


class HeldTicket:
    """The ticket the auth service issued to this peer; ``replace`` it after a renewal."""

    def __init__(self, ticket: str):
        self.ticket = ticket

    def replace(self, ticket: str) -> None:
        self.ticket = ticket

    def ticket_for(self, peer_id: str) -> str:
        return self.ticket


class SelfIssuedTickets:
    """Tickets signed with the auth service's key for whichever peer id asks; renewed before they expire."""

    def __init__(self, key: Ed25519PrivateKey, *, role: str, stage: str, identity: str = "operator"):
        self.key, self.role, self.stage, self.identity = key, role, stage, identity
        self.public_key = public_key_text(key)
        self._issued: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: Path, *, role: str, stage: str) -> "SelfIssuedTickets":
        return cls(load_signing_key(path), role=role, stage=stage)

    def ticket_for(self, peer_id: str) -> str:
        now = time.time()
        with self._lock:
            ticket, expires_at = self._issued.get(peer_id, ("", 0.0))
            if expires_at - now < RENEW_MARGIN_S:
                ticket = issue_ticket(
                    self.key,
                    identity=self.identity,
                    peer_id=peer_id,
                    stage=self.stage,
                    slot=0,
                    ttl_s=SELF_ISSUED_TTL_S,
                    now=now,
                    role=self.role,
                )
                self._issued[peer_id] = (ticket, now + SELF_ISSUED_TTL_S)
            return ticket
