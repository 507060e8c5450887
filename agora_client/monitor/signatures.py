"""Records signed under an owner subkey (``name + [owner:<RSA public key>]``), and the one check the monitor
runs on each: the signer, then the auth ticket, then the ticket's claims.

hivemind's ``RSASignatureValidator`` on every DHT node has already checked that the value is signed by the
key in the subkey; what is left is whether that key is the peer the record names, and whether the peer's
ticket says what the record says.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from agora_client.auth.key_proof import peer_id_of_public_key
from agora_client.auth.tickets import InvalidTicket, TicketClaims, verify_ticket
from agora_client.engine.records import OWNER_KEY_PATTERN, RSASignatureValidator, owner_marker

_OWNER_RE = re.compile(OWNER_KEY_PATTERN)
_CLAIM_LABELS = {"peer_id": "peer", "stage": "stage", "identity": "identity"}


def owner_subkey(name: str, validator: RSASignatureValidator) -> bytes:
    """``name + [owner:<the validator's public key>]``: a subkey only that key's holder can write."""
    return name.encode() + owner_marker(validator)


def has_owner(subkey: object) -> bool:
    return isinstance(subkey, bytes) and _OWNER_RE.search(subkey) is not None


def signer_of(subkey: object, name: str) -> str:
    """The peer id of the key that owns ``subkey``, which must be ``name + [owner:key]``; ValueError says why not."""
    if not isinstance(subkey, bytes):
        raise ValueError("unsigned record: subkey carries no owner key")
    owners = _OWNER_RE.findall(subkey)
    if len(owners) != 1:
        raise ValueError(
            "unsigned record: subkey carries no owner key" if not owners else "several owner keys in subkey"
        )
    if subkey.split(b"[owner:", 1)[0] != name.encode():
        raise ValueError(f"subkey names another entry than {name}")
    try:
        return peer_id_of_public_key(owners[0])
    except ValueError as error:
        raise ValueError(f"unreadable owner key: {error}") from None


def check_signed(
    subkey: object,
    name: str,
    *,
    record: str,
    signer: str,
    ticket: str,
    claims: Mapping[str, str],
    auth_public_key: str,
    now: float | None = None,
) -> TicketClaims:
    """Signer, ticket, claims: ``subkey`` is ``name + [owner:key]`` with the key of peer ``signer``, ``ticket``
    verifies with the auth service's key, and its claims hold the values in ``claims`` (``peer_id``, ``stage``,
    ``identity``). Returns the ticket's claims; ValueError says which step failed (``record`` names the record)."""
    owner = signer_of(subkey, name)
    if owner != signer:
        raise ValueError(f"{record} is signed by the key of peer {owner}")
    try:
        found = verify_ticket(auth_public_key, ticket, now=now)
    except InvalidTicket as error:
        raise ValueError(f"invalid ticket in {record}: {error}") from None
    if any(getattr(found, field) != value for field, value in claims.items()):
        held = " / ".join(f"{_CLAIM_LABELS[field]} {getattr(found, field)}" for field in claims)
        wanted = " / ".join(f"{_CLAIM_LABELS[field]} {value}" for field, value in claims.items())
        raise ValueError(f"ticket is for {held}, not {wanted} ({record})")
    return found
