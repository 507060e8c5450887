"""hivemind's DHT record layer, as the swarm's validators and signed records need it.

hivemind exports none of these: its signature validator (``[owner:<key>]`` subkeys), its schema validator with
ProgressTracker's schema, and the reserved subkeys and msgpack serializer of DHTProtocol, which encodes every
stored subkey and value.
"""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.optim.progress_tracker import TrainingProgressSchema
from hivemind.utils.crypto import RSAPrivateKey

__all__ = [
    "OWNER_KEY_PATTERN",
    "RSASignatureValidator",
    "decode_record_field",
    "is_reserved_subkey",
    "owner_marker",
    "progress_schema_validator",
    "signature_validator",
]

OWNER_KEY_PATTERN = RSASignatureValidator.PUBLIC_KEY_REGEX  # bytes: what an [owner:<key>] marker looks like


def signature_validator(private_key: RSAPrivateKey | None = None) -> RSASignatureValidator:
    """The validator that signs this node's owner-marked records with ``private_key`` (default: hivemind's
    process-wide key) and refuses others' that their owner did not sign."""
    return RSASignatureValidator(private_key)


def owner_marker(validator: RSASignatureValidator) -> bytes:
    """``[owner:<the validator's public key>]``: appended to a subkey, only that key's holder may write it."""
    return validator.local_public_key


def progress_schema_validator(prefix: str) -> RecordValidatorBase:
    """The schema validator a ProgressTracker with this ``prefix`` adds to its own DHT."""
    return SchemaValidator(TrainingProgressSchema, prefix=prefix)


def is_reserved_subkey(subkey: bytes) -> bool:
    """Whether a record's encoded subkey is one DHTProtocol reserves (a bare value, no dictionary entry)."""
    return subkey in DHTProtocol.RESERVED_SUBKEYS


def decode_record_field(data: bytes) -> object:
    """A stored record's subkey or value, decoded as DHTProtocol encoded it (raises on undecodable bytes)."""
    return DHTProtocol.serializer.loads(data)
