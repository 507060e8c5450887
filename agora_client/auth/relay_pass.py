"""Relay passes: the auth service's word that a joiner it could not dial back may reserve a port on the run's relays.

A joiner behind a NAT no port mapping opens holds no ticket yet (it is not admitted until the dial-back through a
relay works), so the 409 answer to its failed dial-back carries a pass instead: claims naming the peer id and the
identity that joined with it, signed with the service's ticket key as tickets are (``tickets.sign_claims``) under
its own domain, so a pass never verifies as a ticket nor a ticket as a pass. The relay, given the service's public
key, checks it; the reservation itself is signed with the peer's own key (``agora_client.relay.proof``), so a
copied pass is useless to anyone without that key.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .tickets import sign_claims, verify_claims

PASS_VERSION = 1
PASS_DOMAIN = b"agora-relay-pass/v1\n"
RELAY_PASS_TTL_S = 900.0  # long enough to reserve and join again through the relay, short enough to be useless later


@dataclass(frozen=True)
class RelayPass:
    identity: str
    peer_id: str
    issued_at: float
    expires_at: float


def issue_relay_pass(
    key: Ed25519PrivateKey, *, identity: str, peer_id: str, ttl_s: float = RELAY_PASS_TTL_S, now: float | None = None
) -> str:
    issued_at = time.time() if now is None else now
    claims = RelayPass(identity, peer_id, issued_at, issued_at + ttl_s)
    return sign_claims(key, {"v": PASS_VERSION, **asdict(claims)}, domain=PASS_DOMAIN)


def verify_relay_pass(public_key: str | Ed25519PublicKey, text: str, *, now: float | None = None) -> RelayPass:
    """Check the signature, then the expiry; the claims, or InvalidTicket (malformed, bad_signature, expired)."""
    return verify_claims(
        public_key, text, RelayPass, version=PASS_VERSION, what="relay pass", domain=PASS_DOMAIN, now=now
    )
