"""Ed25519-signed tickets: the auth service's proof that a peer holds a slot.

A ticket is ``base64url(JSON claims) + "." + base64url(signature over the encoded claims)``,
without padding. Anyone given the service's public key (``public_key_text``) can verify one
offline; the monitor does so before crediting a peer.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

TICKET_VERSION = 1
_MAX_TICKET_CHARS = 4096
ROLES = ("worker", "trainer")  # a worker serves one stage; a trainer (operator) calls forward / backward
TRAINER = "trainer"  # a trainer's ticket names this role, and this stage where a worker's names its stage
TRAINER_TICKET_TTL_S = 3600.0
# What a claim field declared as each type may hold in the JSON (a whole number is a float too).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float)}
_Claims = TypeVar("_Claims")


class InvalidTicket(ValueError):
    """A ticket that must not be honoured; ``reason`` is one of malformed, bad_signature, expired."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class TicketClaims:
    identity: str
    peer_id: str
    stage: str
    slot: int
    issued_at: float
    expires_at: float
    role: str = "worker"  # tickets issued before roles existed were all workers' tickets


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def save_signing_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write the key as unencrypted PKCS#8 PEM readable by its owner only (mode 0600), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, pem)
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.chmod(temporary, 0o600)  # the umask may have narrowed it further, never widened; make it exact
    os.replace(temporary, path)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Read a key written by ``save_signing_key``; ValueError with what to do if it is missing or not Ed25519."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(
            f"no signing key at {path}: create one with generate_signing_key() and save_signing_key()"
        ) from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ValueError(
            f"{path} is not an unencrypted PEM private key; delete it to have a new key generated"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(
            f"{path} holds a {type(key).__name__}, not an Ed25519 key; delete it to have a new key generated"
        )
    return key


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    path = Path(path)
    if path.exists():
        return load_signing_key(path)
    key = generate_signing_key()
    save_signing_key(key, path)
    return key


def public_key_text(key: Ed25519PrivateKey) -> str:
    """The raw 32-byte public key in standard base64: what verifiers are configured with."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def load_public_key(text: str) -> Ed25519PublicKey:
    """Parse ``public_key_text`` output; ValueError if it is not a base64 32-byte Ed25519 key."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError, AttributeError):
        raise ValueError("the public key is not base64 text; copy it from the auth service's /v1/status") from None
    if len(raw) != 32:
        raise ValueError(
            f"the public key decodes to {len(raw)} bytes, an Ed25519 key has 32; copy it again from /v1/status"
        )
    return Ed25519PublicKey.from_public_bytes(raw)


def issue_ticket(
    key: Ed25519PrivateKey,
    *,
    identity: str,
    peer_id: str,
    stage: str,
    slot: int,
    ttl_s: float,
    now: float | None = None,
    role: str = "worker",
) -> str:
    if ttl_s <= 0:
        raise ValueError(f"ticket ttl_s must be positive, got {ttl_s}")
    if role not in ROLES:
        raise ValueError(f"ticket role must be one of {', '.join(ROLES)}, got {role!r}")
    issued_at = time.time() if now is None else now
    claims = TicketClaims(identity, peer_id, stage, int(slot), issued_at, issued_at + ttl_s, role)
    return sign_claims(key, {"v": TICKET_VERSION, **asdict(claims)})


def sign_claims(key: Ed25519PrivateKey, claims: dict, *, domain: bytes = b"") -> str:
    """``base64url(JSON claims) + "." + base64url(signature)``; the signature covers ``domain`` + the encoded claims,
    so texts signed for one purpose (a relay pass) never verify as another's (a ticket, signed with no domain)."""
    encoded = _b64encode(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode("utf-8"))
    return f"{encoded}.{_b64encode(key.sign(domain + encoded.encode('ascii')))}"


def _open_signed(public_key: str | Ed25519PublicKey, text: str, *, what: str = "ticket", domain: bytes = b"") -> Any:
    """The JSON claims of a ``sign_claims`` text once its signature holds; InvalidTicket (malformed, bad_signature)
    naming ``what`` otherwise. The claims are not checked: ``verify_claims`` does."""
    verifier = load_public_key(public_key) if isinstance(public_key, str) else public_key
    if not isinstance(text, str) or len(text) > _MAX_TICKET_CHARS or text.count(".") != 1:
        raise InvalidTicket("malformed", f"malformed {what}: expected two base64url parts joined by one '.'")
    encoded, encoded_signature = text.split(".")
    try:
        signature = _b64decode(encoded_signature)
    except ValueError:
        raise InvalidTicket("malformed", f"malformed {what}: the signature part is not base64url") from None
    try:
        verifier.verify(signature, domain + encoded.encode("ascii"))
    except (InvalidSignature, UnicodeEncodeError):
        raise InvalidTicket(
            "bad_signature", f"{what} signature does not match: it was altered or issued by another auth service"
        ) from None
    try:
        return json.loads(_b64decode(encoded))
    except ValueError:
        raise InvalidTicket("malformed", f"malformed {what}: its claims are not JSON") from None


def verify_ticket(public_key: str | Ed25519PublicKey, ticket: str, *, now: float | None = None) -> TicketClaims:
    """Check the signature, then the expiry; return the claims or raise InvalidTicket saying why."""
    return verify_claims(public_key, ticket, TicketClaims, version=TICKET_VERSION, now=now)


def verify_claims(
    public_key: str | Ed25519PublicKey,
    text: str,
    claims_type: type[_Claims],
    *,
    version: int,
    what: str = "ticket",
    domain: bytes = b"",
    now: float | None = None,
) -> _Claims:
    """The ``claims_type`` (a dataclass with ``expires_at``) of a ``sign_claims`` text: its signature, its version,
    each field's type as the dataclass declares it, then its expiry; InvalidTicket (malformed, bad_signature,
    expired) naming ``what`` otherwise."""
    data = _open_signed(public_key, text, what=what, domain=domain)
    try:
        if data.pop("v") != version:
            raise ValueError("version")
        claims = claims_type(**data)
        if not _well_typed(claims):
            raise ValueError("types")
    except (ValueError, TypeError, KeyError, AttributeError):
        # Signed but unreadable: a service of another version signed it.
        raise InvalidTicket("malformed", f"malformed {what}: its claims are not version {version} claims") from None
    current = time.time() if now is None else now
    if current >= claims.expires_at:
        raise InvalidTicket(
            "expired", f"{what} expired {current - claims.expires_at:.0f}s ago; join the swarm again for a new one"
        )
    return claims


def _well_typed(claims: Any) -> bool:
    """Each field of the claims dataclass holds what its declared type allows."""
    for item in fields(claims):
        declared = item.type if isinstance(item.type, str) else item.type.__name__  # postponed annotations are text
        if not isinstance(getattr(claims, item.name), _FIELD_TYPES[declared]):
            return False
    return True


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None
