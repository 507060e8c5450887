"""Proof of key: a joiner signs its join with the RSA key its libp2p peer id is derived from.

Without it, anyone who learned a new contributor's peer id before its first join could bind that id
to an account of their own (bindings go to the first account that joins with an id). The joiner sends
its public key and a signature over ``agora-join/v1``, its peer id, the signing time and the sha256 of
its token; the service derives the peer id from the key, checks the signature and the time. Tying the
signature to the token means a proof seen in transit cannot be replayed under another account.
"""

from __future__ import annotations

import hashlib
from typing import Any

import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from agora_client.engine.identity import encoded_public_key

from .secret import Secret, token_fingerprint

MAX_SKEW_S = 300.0
"""How far a proof's signing time may lie from the service's clock (either way): clocks of home machines drift."""
MAX_KEY_CHARS = 2048
MAX_PROOF_CHARS = 2048


class KeyProofError(ValueError):
    """A join whose key proof is missing or does not hold; the message says which part failed."""


def peer_id_of_public_key(openssh_public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key (as hivemind's PeerID.from_identity derives it)."""
    public_key = serialization.load_ssh_public_key(openssh_public_key)
    if not isinstance(public_key, rsa.RSAPublicKey):
        raise ValueError("the key is not an RSA key")
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = encoded_public_key(der)
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def _message(peer_id: str, signed_at: int, token: Secret) -> bytes:
    return f"agora-join/v1\n{peer_id}\n{signed_at}\n{token_fingerprint(token)}".encode("utf-8")


def sign_join(key: RSAPrivateKey, peer_id: str, token: Secret, now: float) -> dict[str, Any]:
    """The fields a join adds to prove it holds ``key`` (whose peer id is ``peer_id``)."""
    signed_at = int(now)
    return {
        "peer_key": key.get_public_key().to_bytes().decode("ascii"),
        "signed_at": signed_at,
        "key_proof": key.sign(_message(peer_id, signed_at, token)).decode("ascii"),
    }


def check_join_proof(body: dict[str, Any], peer_id: str, token: Secret, now: float) -> None:
    """Raise KeyProofError unless ``body`` proves that its sender holds the key of ``peer_id``."""
    peer_key, signed_at, proof = body.get("peer_key"), body.get("signed_at"), body.get("key_proof")
    if peer_key is None or signed_at is None or proof is None:
        raise KeyProofError(
            "this swarm asks every joiner to prove it holds its peer key (peer_key, signed_at, key_proof); "
            "update the Agora client"
        )
    if not (
        isinstance(peer_key, str)
        and isinstance(proof, str)
        and len(peer_key) <= MAX_KEY_CHARS
        and len(proof) <= MAX_PROOF_CHARS
        and isinstance(signed_at, int)
        and not isinstance(signed_at, bool)
    ):
        raise KeyProofError("peer_key and key_proof must be short text and signed_at a whole number of seconds")
    public_key = public_key_of_peer(peer_key, peer_id, "the join")
    if abs(now - signed_at) > MAX_SKEW_S:
        raise KeyProofError(
            f"the join was signed at a time {abs(now - signed_at):.0f} s off the service's clock (at most "
            f"{MAX_SKEW_S:.0f} s either way); set this machine's clock right (enable NTP) and join again"
        )
    if not public_key.verify(_message(peer_id, signed_at, token), proof.encode("utf-8")):
        raise KeyProofError(f"the key proof does not verify: this join was not signed by the key of peer id {peer_id}")


def public_key_of_peer(peer_key: str, peer_id: str, sent_with: str) -> RSAPublicKey:
    """``peer_key`` (OpenSSH text) as a key, once it is the key ``peer_id`` derives from; KeyProofError otherwise."""
    try:
        owner = peer_id_of_public_key(peer_key.encode("utf-8"))
        public_key = RSAPublicKey.from_bytes(peer_key.encode("utf-8"))
    except (ValueError, UnsupportedAlgorithm):
        raise KeyProofError("peer_key is not an RSA public key in OpenSSH form") from None
    if owner != peer_id:
        raise KeyProofError(f"the key sent with {sent_with} is the key of peer id {owner}, not of {peer_id}")
    return public_key
