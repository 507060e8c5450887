"""The record validators every DHT node of the swarm runs: seeds, workers, trainers and the monitor.

hivemind asks a node's validators about a record when a peer asks the node to store it and when the
node reads it in a lookup answer, so a record refused here is refused by every node, at write time.

- ``RSASignatureValidator``: a record whose key or subkey names an owner key (``[owner:ssh-rsa ...]``)
  must be signed by that key; hivemind's process-wide key signs this node's own records.
- ``SwarmSchemaValidator``: the swarm's own keys (roster, metrics, verdicts, receipts) hold only well-formed
  records under the subkey their record names; metrics, verdicts and receipts only under an owner subkey.
- hivemind's ``SchemaValidator`` for the stages' ProgressTracker keys (the one a tracker adds to its
  own DHT, installed here on every node).

A DHT key is stored as the hash of its name, so the stage keys are known by enumerating the stage
names a run config can have: head, tail and body1..body{MAX_BODIES}.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ValidationError

from agora_client.discovery.roster import WorkerRecord, progress_prefix, roster_key
from agora_client.discovery.signed_records import (
    RECEIPTS_KEY,
    VERDICTS_KEY,
    MetricsRecord,
    Receipt,
    Verdict,
    metrics_key,
)
from agora_client.engine.records import (
    decode_record_field,
    is_reserved_subkey,
    progress_schema_validator,
    signature_validator,
)

MAX_BODIES = 254
_OWNER = b"[owner:"


def possible_stage_names(max_bodies: int = MAX_BODIES) -> list[str]:
    return ["head", "tail", *(f"body{index}" for index in range(1, max_bodies + 1))]


@dataclass(frozen=True)
class KeySchema:
    """What one swarm key may hold: ``model`` records, each under the subkey ``subkey_name(record)`` names."""

    model: type[BaseModel]
    subkey_name: Callable[[BaseModel], str]
    signed: bool  # the subkey must be ``name + [owner:key]`` (the signature validator then checks the signature)
    withdrawable: bool = False  # None is a valid value: the owner withdrawing its entry before it expires


class SwarmSchemaValidator(RecordValidatorBase):
    """Refuses malformed records under the swarm's keys; other keys (hivemind's averaging) pass through."""

    def __init__(self, schemas: Mapping[str, KeySchema]):
        self._schemas = {DHTID.generate(source=name).to_bytes(): schema for name, schema in schemas.items()}

    def validate(self, record: DHTRecord) -> bool:
        schema = self._schemas.get(record.key)
        if schema is None:
            return True
        if is_reserved_subkey(record.subkey):
            return False  # the swarm's keys hold one entry per owner, never a bare value
        try:
            subkey = decode_record_field(record.subkey)
            value = decode_record_field(record.value)
        except Exception:  # undecodable bytes from a stranger: refuse, whatever msgpack raised
            return False
        if value is None:
            return schema.withdrawable and _subkey_is_well_formed(subkey, schema.signed)
        try:
            parsed = schema.model.model_validate(value, strict=True)
        except ValidationError:
            return False
        return subkey_names(subkey, schema.subkey_name(parsed), signed=schema.signed)

    @property
    def priority(self) -> int:
        return 0  # after the signature validator has checked and stripped the signature


def subkey_names(subkey: object, name: str, *, signed: bool) -> bool:
    """Whether ``subkey`` is ``name`` (unsigned keys) or ``name + [owner:key]`` with exactly one owner key."""
    if not signed:
        return subkey == name
    return isinstance(subkey, bytes) and subkey.count(_OWNER) == 1 and subkey.split(_OWNER, 1)[0] == name.encode()


def _subkey_is_well_formed(subkey: object, signed: bool) -> bool:
    return isinstance(subkey, bytes) and subkey.count(_OWNER) == 1 if signed else isinstance(subkey, str)


def swarm_key_schemas(stages: Iterable[str]) -> dict[str, KeySchema]:
    by_peer = attrgetter("peer_id")
    schemas = {
        VERDICTS_KEY: KeySchema(Verdict, attrgetter("subkey_name"), signed=True),
        RECEIPTS_KEY: KeySchema(Receipt, attrgetter("subkey_name"), signed=True),
    }
    for stage in stages:
        schemas[roster_key(stage)] = KeySchema(WorkerRecord, by_peer, signed=False, withdrawable=True)
        schemas[metrics_key(stage)] = KeySchema(MetricsRecord, by_peer, signed=True)
    return schemas


def record_validators(private_key: RSAPrivateKey | None = None) -> list[RecordValidatorBase]:
    """The validators of every swarm DHT node; the signature validator comes first (it signs with ``private_key``,
    default hivemind's process-wide key)."""
    stages = possible_stage_names()
    return [
        signature_validator(private_key),
        SwarmSchemaValidator(swarm_key_schemas(stages)),
        *(progress_schema_validator(progress_prefix(stage)) for stage in stages),
    ]
