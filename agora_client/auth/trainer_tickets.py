"""A trainer's tickets from the auth service, in exchange for its credential (auth/trainer_credentials.py).

A trainer calls workers from one libp2p peer per stage and signs verdicts and receipts with its DHT key:
each of those peer ids needs a ticket naming it. ``IssuedTrainerTickets`` asks the service for one the first
time a peer id needs it and again before it expires; if a renewal fails (service down, credential revoked),
the ticket it holds serves until it expires, and the next call asks again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .client import AuthFailed, call_service
from .secret import Secret

RENEW_MARGIN_S = 300.0  # ask again this long before a ticket expires (trainer tickets live TRAINER_TICKET_TTL_S)
RETRY_S = 30.0  # after a failed renewal, the held ticket serves this long before the service is asked again
CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Held:
    ticket: str
    expires_at: float
    ask_again_at: float  # before this, the ticket is used as it is


class IssuedTrainerTickets:
    """A TicketSource (auth/ticket_source.py) for a trainer on a host without the signing key."""

    def __init__(self, auth_url: str, credential: Secret):
        self.auth_url, self._credential = auth_url, credential
        self._issued: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def ticket_for(self, peer_id: str) -> str:
        """The ticket for calls from ``peer_id``; AuthFailed when the service gives none and none is left."""
        with self._lock:
            held, now = self._issued.get(peer_id), time.time()
            if held is not None and now < held.ask_again_at:
                return held.ticket
            try:
                reply = call_service(
                    self.auth_url,
                    "/v1/trainer/ticket",
                    {"credential": self._credential.reveal(), "peer_id": peer_id},
                    CALL_TIMEOUT_S,
                )
            except AuthFailed:
                if held is None or held.expires_at <= now:
                    raise
                self._issued[peer_id] = _Held(held.ticket, held.expires_at, now + RETRY_S)
                return held.ticket
            expires_at = float(reply["expires_at"])
            self._issued[peer_id] = _Held(str(reply["ticket"]), expires_at, expires_at - RENEW_MARGIN_S)
            return self._issued[peer_id].ticket
