"""Signed worker metrics in the DHT.

A worker stores its ``MetricsRecord`` under key ``agora.metrics.<stage>`` with subkey
``<peer id bytes> + [owner:<its RSA public key>]``. hivemind's ``RSASignatureValidator``
signs such a subkey's value and every DHT node carrying the validator rejects a value whose
signature does not match the key in the subkey, so only that key's holder can write it.

The monitor then keeps a record only if
- its subkey carries an owner key at all (an unsigned record passes the DHT's validation untouched),
- that key *is* the record's peer: the libp2p peer id derived from it equals ``record.peer_id``
  (so nobody can sign a record for another peer under a key of their own),
- its auth ticket verifies with the auth service's public key and names the same peer, stage
  and identity as the record.

For the key-to-peer binding the worker's DHT must run on the same RSA key as its validator:
start it with ``signed_dht_kwargs(path)`` (identity file + validator of hivemind's process-wide key).
The record's schema and key are in agora_client.discovery.signed_records, the signature checks in
``signatures``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from agora_client.auth.tickets import TicketClaims
from agora_client.discovery.replica_drift import replica_drift
from agora_client.discovery.signed_records import MetricsRecord, metrics_key
from agora_client.discovery.validators import record_validators
from agora_client.engine.identity import write_identity_file
from agora_client.engine.records import RSASignatureValidator
from agora_client.monitor.signatures import check_signed, has_owner, owner_subkey


@dataclass(frozen=True)
class VerifiedRecord:
    record: MetricsRecord
    claims: TicketClaims
    expiration_time: float


def metrics_subkey(peer_id: str, validator: RSASignatureValidator) -> bytes:
    return owner_subkey(peer_id, validator)


def signed_dht_kwargs(identity_path: Path | str, key: RSAPrivateKey | None = None) -> dict[str, Any]:
    """DHT(...) keyword arguments for a worker whose metrics the monitor will accept."""
    write_identity_file(identity_path, key)
    return {"identity_path": str(identity_path), "record_validators": record_validators(key)}


def create_signed_dht(
    identity_path: Path | str, key: RSAPrivateKey | None = None, **dht_kwargs: Any
) -> tuple[DHT, RSASignatureValidator]:
    """A started DHT whose peer id and metrics signatures come from the same RSA key."""
    kwargs = signed_dht_kwargs(identity_path, key)
    dht = DHT(start=True, **kwargs, **dht_kwargs)
    return dht, kwargs["record_validators"][0]


def publish_metrics(dht: DHT, record: MetricsRecord, validator: RSASignatureValidator, ttl: float) -> bool:
    """Store the record signed under this peer's subkey; True if at least one DHT node accepted it."""
    return bool(
        dht.store(
            metrics_key(record.stage),
            record.model_dump(mode="json"),
            expiration_time=get_dht_time() + ttl,
            subkey=metrics_subkey(record.peer_id, validator),
        )
    )


def check_entry(
    stage: str, subkey: object, value: object, auth_public_key: str, *, now: float | None = None
) -> tuple[MetricsRecord, TicketClaims]:
    """Verify one DHT entry (already signature-checked by a DHT node with the validator). Raises ValueError why not."""
    if not has_owner(subkey):
        raise ValueError("unsigned record: subkey carries no owner key")
    try:
        record = MetricsRecord.model_validate(value)
    except ValidationError as error:
        raise ValueError(f"malformed metrics record: {error.errors()[0]['msg']}") from None
    if record.stage != stage:
        raise ValueError(f"record says stage {record.stage} but was published under {stage}")
    claims = check_signed(
        subkey,
        record.peer_id,
        record=f"record for {record.peer_id}",
        signer=record.peer_id,
        ticket=record.ticket,
        claims={"peer_id": record.peer_id, "stage": record.stage, "identity": record.identity},
        auth_public_key=auth_public_key,
        now=now,
    )
    return record, claims


def fetch_metrics(
    dht: DHT,
    stages: Iterable[str],
    auth_public_key: str,
    *,
    now: float | None = None,
    on_reject: Callable[[str], None] | None = None,
) -> list[VerifiedRecord]:
    """Every verified metrics record of these stages. ``dht`` must carry an RSASignatureValidator."""
    verified = []
    for stage in stages:
        found = dht.get(metrics_key(stage), latest=True)
        if found is None or not isinstance(found.value, dict):
            continue
        for subkey, entry in found.value.items():
            try:
                record, claims = check_entry(stage, subkey, entry.value, auth_public_key, now=now)
            except ValueError as error:
                if on_reject is not None:
                    on_reject(f"{stage}: {error}")
                continue
            verified.append(VerifiedRecord(record=record, claims=claims, expiration_time=entry.expiration_time))
    return verified


def fetch_replica_drifts(dht: DHT, stages: Iterable[str], auth_public_key: str) -> dict[str, float | None]:
    """Each stage's replica drift (agora_client/discovery/replica_drift.py) from its workers' verified records."""
    stages = list(stages)
    records = [verified.record for verified in fetch_metrics(dht, stages, auth_public_key)]
    return {stage: replica_drift(record for record in records if record.stage == stage) for stage in stages}
