"""The swarm's record schema, record by record (the DHT-level behaviour is in test_dht_validation)."""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.discovery.roster import WorkerRecord, roster_key
from agora_client.discovery.signed_records import metrics_key
from agora_client.discovery.validators import (
    SwarmSchemaValidator,
    possible_stage_names,
    record_validators,
    swarm_key_schemas,
)
from agora_client.monitor.signatures import owner_subkey

VALIDATOR = SwarmSchemaValidator(swarm_key_schemas(possible_stage_names()))
pack = DHTProtocol.serializer.dumps


def record(key: str, subkey, value) -> DHTRecord:
    return DHTRecord(DHTID.generate(source=key).to_bytes(), pack(subkey), pack(value), 0.0)


def test_roster_entries() -> None:
    entry = WorkerRecord(uid="body7.0.0", peer_id="peerA", stage="body7", sync_phase=2).model_dump()
    assert VALIDATOR.validate(record(roster_key("body7"), "peerA", entry))
    assert VALIDATOR.validate(record(roster_key("body7"), "peerA", None))  # a withdrawal
    assert not VALIDATOR.validate(record(roster_key("body7"), "peerB", entry))  # under another peer's subkey
    assert not VALIDATOR.validate(record(roster_key("body7"), "peerA", {**entry, "sync_phase": 3}))
    assert not VALIDATOR.validate(record(roster_key("body7"), "peerA", {**entry, "epoch": "1"}))  # no coercion
    assert not VALIDATOR.validate(record(roster_key("body7"), "peerA", [1, 2]))
    bare = DHTRecord(
        DHTID.generate(source=roster_key("body7")).to_bytes(), DHTProtocol.IS_REGULAR_VALUE, pack(entry), 0.0
    )
    assert not VALIDATOR.validate(bare)
    garbage = DHTRecord(DHTID.generate(source=roster_key("body7")).to_bytes(), b"\xc1\xc1", b"\xc1", 0.0)
    assert not VALIDATOR.validate(garbage)


def test_metrics_need_an_owner_subkey_naming_their_peer() -> None:
    signer = RSASignatureValidator(RSAPrivateKey())
    value = {
        "v": 1,
        "peer_id": "peerA",
        "identity": "alice",
        "ticket": "t",
        "stage": "head",
        "run_id": "r",
        "sync_phase": "active",
        "flops_total": 1.0,
        "compute_flops": 1.0,
        "active_seconds": 1.0,
        "busy_seconds": 1.0,
        "batches": 1,
        "forwards": 1,
        "tokens": 1,
        "ts": 1.0,
    }
    assert VALIDATOR.validate(record(metrics_key("head"), owner_subkey("peerA", signer), value))
    assert not VALIDATOR.validate(record(metrics_key("head"), b"peerA", value))
    assert not VALIDATOR.validate(record(metrics_key("head"), owner_subkey("peerB", signer), value))
    assert not VALIDATOR.validate(
        record(metrics_key("head"), owner_subkey("peerA", signer), {**value, "compute_flops": -1.0})
    )


def test_other_keys_pass_and_the_signature_validator_comes_first() -> None:
    assert VALIDATOR.validate(record("agora_body1_sparta.0b01", "x", {"anything": 1}))
    validators = record_validators(RSAPrivateKey())
    assert isinstance(validators[0], RSASignatureValidator)
    assert "body254" in possible_stage_names()
