"""Who may call this worker: the ticket on an RPC is checked before anything else in it is read.

The ticket must be signed by the swarm's auth service, unexpired, name the calling libp2p peer
(libp2p authenticates the remote peer id, so a ticket copied by another peer is refused), and carry
a role allowed for the call: trainers for forward / backward, same-stage workers for averaging.
"""

from __future__ import annotations

import time

from agora_client.auth.tickets import InvalidTicket, TicketClaims, load_public_key, verify_ticket
from agora_client.serving.validation import RequestRejected

_CACHE_LIMIT = 4096  # verified tickets remembered (signature checked once per ticket, expiry every call)


class TicketRejected(RequestRejected):
    """A call whose ticket is missing or not valid for it; ``reason`` says which check failed."""


class TicketGate:
    def __init__(self, public_key: str, *, roles: tuple[str, ...], stage: str | None = None):
        self._verifier = load_public_key(public_key)
        self.roles, self.stage = roles, stage
        self._verified: dict[str, TicketClaims] = {}

    def check(self, presented: bytes, caller: str, now: float | None = None) -> TicketClaims:
        """Return the ticket's claims, or raise TicketRejected saying what is wrong and what to do."""
        if not presented:
            raise TicketRejected(
                "no_ticket",
                "the request carries no ticket: join the swarm through its auth service "
                "(trainers: start with --ticket-key pointing at the auth service's signing key)",
            )
        try:
            ticket = presented.decode("ascii")
        except UnicodeDecodeError:
            raise TicketRejected(
                "malformed_ticket", "the ticket is not ASCII text; present the ticket the auth service issued"
            ) from None
        now = time.time() if now is None else now
        claims = self._verified.get(ticket)
        try:
            if claims is None:
                claims = verify_ticket(self._verifier, ticket, now=now)
                if len(self._verified) >= _CACHE_LIMIT:
                    self._verified.clear()
                self._verified[ticket] = claims
            elif now >= claims.expires_at:
                raise InvalidTicket(
                    "expired", f"ticket expired {now - claims.expires_at:.0f}s ago; join the swarm again for a new one"
                )
        except InvalidTicket as error:
            raise TicketRejected(f"{error.reason}_ticket", str(error)) from None
        if claims.peer_id != caller:
            raise TicketRejected(
                "wrong_peer", f"the ticket was issued to peer {claims.peer_id}, not to the caller {caller}"
            )
        if claims.role not in self.roles:
            raise TicketRejected(
                "wrong_role",
                f"a {claims.role} ticket may not make this call; it needs a {' or '.join(self.roles)} ticket",
            )
        if self.stage is not None and claims.stage != self.stage:
            raise TicketRejected(
                "wrong_stage", f"the ticket is for stage {claims.stage}; only {self.stage} peers may make this call"
            )
        return claims
