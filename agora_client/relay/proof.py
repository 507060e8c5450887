"""Who may reserve: a joiner the auth service sent to the relay, proved by its own key.

A reserve carries a credential from the auth service: the relay pass its 409 answer to a failed dial-back gave
(``auth.relay_pass``), or, once admitted, the worker's ticket (``auth.tickets``); both name a peer id and are
signed with the service's key, whose public half the relay is given. The reserve is also signed with that peer's
own libp2p key over a fresh timestamp, a random nonce and the credential, so a copied pass (or a reserve seen on the
wire) gets no one a port: the relay refuses another key, a stale time and a nonce it has seen.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agora_client.auth.key_proof import (
    MAX_KEY_CHARS,
    MAX_PROOF_CHARS,
    MAX_SKEW_S,
    KeyProofError,
    peer_id_of_public_key,
    public_key_of_peer,
)
from agora_client.auth.relay_pass import verify_relay_pass
from agora_client.auth.tickets import InvalidTicket, verify_ticket

RESERVE_DOMAIN = "agora-relay-reserve/v1"


class ReserveRefused(Exception):
    """A reserve whose credential or signature does not hold; ``reason`` is a short code for the operator's metrics."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Reserver:
    """Whom a proved reserve is for: the peer id and the identity that joined with it."""

    peer_id: str
    identity: str


class PeerCredentials:
    """The worker's side: its libp2p key (``RSAPrivateKey``) and where its current pass or ticket comes from."""

    def __init__(self, key: Any, credential: Callable[[], str]):
        self.key, self.credential = key, credential
        self.peer_key = key.get_public_key().to_bytes().decode("ascii")
        self.peer_id = peer_id_of_public_key(self.peer_key.encode("ascii"))

    def sign(self, now: float | None = None) -> dict[str, Any]:
        """The fields a reserve adds: the credential, the public key and the signature over a fresh time and nonce."""
        credential, signed_at, nonce = (
            self.credential(),
            int(time.time() if now is None else now),
            secrets.token_hex(16),
        )
        proof = self.key.sign(_message(self.peer_id, signed_at, nonce, credential)).decode("ascii")
        return {
            "peer_id": self.peer_id,
            "pass": credential,
            "peer_key": self.peer_key,
            "signed_at": signed_at,
            "nonce": nonce,
            "proof": proof,
        }


def _message(peer_id: str, signed_at: int, nonce: str, credential: str) -> bytes:
    digest = hashlib.sha256(credential.encode("utf-8")).hexdigest()
    return f"{RESERVE_DOMAIN}\n{peer_id}\n{signed_at}\n{nonce}\n{digest}".encode("utf-8")


class SeenNonces:
    """Nonces of reserves proved within the clock skew window: a reserve replayed inside it is refused. At most
    ``limit`` are kept (the oldest go first), so a flood of signed reserves cannot grow the relay without bound."""

    def __init__(self, limit: int = 65536) -> None:
        self.limit = limit
        self._seen: dict[str, float] = {}  # in the order they came, so the oldest are first

    def first_time(self, nonce: str, now: float) -> bool:
        while self._seen and (len(self._seen) >= self.limit or now - next(iter(self._seen.values())) > 2 * MAX_SKEW_S):
            del self._seen[next(iter(self._seen))]
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


def check_reserve(request: dict[str, Any], auth_public_key: Any, now: float, seen: SeenNonces) -> Reserver:
    """The reserver of ``request`` once its credential and signature hold and its nonce is new; ReserveRefused
    saying why otherwise."""
    credential = request.get("pass")
    if credential is None:
        raise ReserveRefused(
            "no_pass",
            "this relay serves only joiners the swarm's auth service sent to it, and the reserve carries no relay "
            "pass; update the Agora client",
        )
    reserver = _holder(credential, auth_public_key, now)
    peer_key, signed_at, nonce, proof = (request.get(name) for name in ("peer_key", "signed_at", "nonce", "proof"))
    if not (
        isinstance(peer_key, str)
        and len(peer_key) <= MAX_KEY_CHARS
        and isinstance(proof, str)
        and len(proof) <= MAX_PROOF_CHARS
        and isinstance(nonce, str)
        and 16 <= len(nonce) <= 64
        and isinstance(signed_at, int)
        and not isinstance(signed_at, bool)
    ):
        raise ReserveRefused(
            "malformed", "malformed reserve: peer_key, nonce and proof must be short text, signed_at whole seconds"
        )
    if request.get("peer_id") != reserver.peer_id:
        raise ReserveRefused("wrong_peer", f"the relay pass is for peer id {reserver.peer_id}, not for this reserve's")
    try:
        public_key = public_key_of_peer(peer_key, reserver.peer_id, "the reserve")
    except KeyProofError as error:
        raise ReserveRefused("wrong_key", f"{error}: a relay pass serves only the key it was issued to") from None
    if abs(now - signed_at) > MAX_SKEW_S:
        raise ReserveRefused(
            "stale",
            f"the reserve was signed at a time {abs(now - signed_at):.0f} s off the relay's clock (at most "
            f"{MAX_SKEW_S:.0f} s either way); set this machine's clock right (enable NTP)",
        )
    if not public_key.verify(_message(reserver.peer_id, signed_at, nonce, credential), proof.encode("utf-8")):
        raise ReserveRefused("bad_signature", f"the reserve was not signed by the key of peer id {reserver.peer_id}")
    if not seen.first_time(nonce, now):
        raise ReserveRefused("replayed", "this reserve was sent before; sign each reserve anew")
    return reserver


def _holder(credential: Any, auth_public_key: Any, now: float) -> Reserver:
    """Whom a relay pass, or else a worker's ticket, names; ReserveRefused if it is neither or it expired."""
    try:
        claims = verify_relay_pass(auth_public_key, credential, now=now)
        return Reserver(claims.peer_id, claims.identity)
    except InvalidTicket as error:
        if error.reason == "expired":
            raise ReserveRefused("expired_pass", str(error)) from None
        not_a_pass = error
    try:
        ticket = verify_ticket(auth_public_key, credential, now=now)
    except InvalidTicket as error:
        if error.reason == "expired":
            raise ReserveRefused("expired_pass", str(error)) from None
        raise ReserveRefused("bad_pass", str(not_a_pass)) from None
    if ticket.role != "worker":
        raise ReserveRefused("bad_pass", "a trainer's ticket is not a relay pass")
    return Reserver(ticket.peer_id, ticket.identity)
