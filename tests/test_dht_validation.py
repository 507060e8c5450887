"""Every DHT node validates records, seeds included: forged records written to a real seed are refused.

The attackers are raw hivemind DHT peers in client mode (they store nothing themselves), so what
``store`` reports and what a reader finds is what the seed (a real `agora seed` process, the only
server in its swarm) accepted. A seed without the validators, given the same forgeries, stores them:
that is the hole this closes, and it shows the checks can fail.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth.tickets import generate_signing_key, issue_ticket, public_key_text
from agora_client.config import load_config
from agora_client.discovery.roster import WorkerRecord, announce, fetch_roster, roster_key
from agora_client.discovery.seed import READY_PREFIX
from agora_client.discovery.signed_records import (
    RECEIPTS_KEY,
    VERDICTS_KEY,
    MetricsRecord,
    Receipt,
    ServedCounts,
    Verdict,
    metrics_key,
)
from agora_client.discovery.validators import record_validators
from agora_client.monitor.receipts import fetch_receipts
from agora_client.monitor.records import create_signed_dht, metrics_subkey, publish_metrics
from agora_client.monitor.signatures import owner_subkey
from agora_client.monitor.verdicts import fetch_verdicts, publish_verdict, trainer_peer_id
from agora_client.swarm.processes import ManagedProcess
from agora_client.trainer.balancer import Router
from agora_client.trainer.receipts import publish_receipt
from agora_client.trainer.roster_watcher import RosterWatcher
from agora_client.worker.metrics import WorkerMetrics
from tests.ticket_helpers import trainer_ticket

pytestmark = pytest.mark.integration
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TTL = 300.0


class ForgingValidator(RSASignatureValidator):
    """An attacker's validator: signs every record with its own key, whoever's owner subkey it names."""

    def sign_value(self, record):
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


def client(seeds: list[str], **kwargs) -> DHT:
    return DHT(start=True, initial_peers=seeds, client_mode=True, **kwargs)


def later() -> float:
    """A fresh expiration: each forgery is newer than the one before it, so none is dropped for being stale."""
    return get_dht_time() + TTL


def active_metrics(peer_id: str, auth_key) -> MetricsRecord:
    ticket = issue_ticket(auth_key, identity="alice", peer_id=peer_id, stage="body1", slot=0, ttl_s=3600)
    metrics = WorkerMetrics(load_config("tiny").model, "body1", peer_id=peer_id, identity="alice", ticket=ticket)
    metrics.set_phase("active")
    return metrics.snapshot()


def forgeries(victim: DHT, victim_validator: RSASignatureValidator, seeds: list[str], auth_key) -> dict[str, bool]:
    """Try every forgery against the swarm of ``seeds``; name -> whether any node accepted the write."""
    victim_id = victim.peer_id.to_base58()
    inflated = active_metrics(victim_id, auth_key).model_copy(update={"compute_flops": 1e21}).model_dump(mode="json")
    raw, forger = client(seeds), client(seeds, record_validators=[ForgingValidator(RSAPrivateKey())])
    try:
        roster = WorkerRecord(uid="body1.0.0", peer_id=victim_id, stage="body1").model_dump()
        trainer = RSASignatureValidator(RSAPrivateKey())
        verdict = Verdict(
            trainer=trainer_peer_id(trainer),
            ticket=trainer_ticket(auth_key, trainer),
            peer_id=victim_id,
            uid="body1.0.0",
            stage="body1",
            checks=5,
            disagreements=5,
            ts=get_dht_time(),
        )
        receipt = Receipt(
            trainer=trainer_peer_id(trainer),
            ticket=trainer_ticket(auth_key, trainer),
            run_id="r1",
            served={victim_id: ServedCounts(stage="body1", forwards=1, backwards=1, flops=1e21)},
            ts=get_dht_time(),
        )
        return {
            "metrics signed by another key": forger.store(
                metrics_key("body1"), inflated, later(), subkey=metrics_subkey(victim_id, victim_validator)
            ),
            "unsigned metrics": raw.store(metrics_key("body1"), inflated, later(), subkey=victim_id.encode()),
            "roster entry with an unknown phase": raw.store(
                roster_key("body1"), {**roster, "sync_phase": 7}, later(), subkey=victim_id
            ),
            "roster entry under another peer's subkey": raw.store(
                roster_key("body1"), roster, later(), subkey="someone-else"
            ),
            "roster as a bare value": raw.store(roster_key("body1"), roster, later()),
            "roster entry of random bytes": raw.store(roster_key("body1"), b"\x00\xff" * 64, later(), subkey=victim_id),
            "unsigned verdict": raw.store(
                VERDICTS_KEY, verdict.model_dump(mode="json"), later(), subkey=verdict.subkey_name.encode()
            ),
            "verdict signed by a key it does not name": forger.store(
                VERDICTS_KEY,
                verdict.model_dump(mode="json"),
                later(),
                subkey=owner_subkey(verdict.subkey_name, trainer),
            ),
            "receipt signed by a key it does not name": forger.store(
                RECEIPTS_KEY,
                receipt.model_dump(mode="json"),
                later(),
                subkey=owner_subkey(receipt.subkey_name, trainer),
            ),
            "unsigned stage progress": raw.store(
                "agora.progress.body1_progress",
                {
                    "peer_id": victim.peer_id.to_bytes(),
                    "epoch": 1000,
                    "samples_accumulated": 10**9,
                    "samples_per_second": 1.0,
                    "time": get_dht_time(),
                    "client_mode": False,
                },
                later(),
                subkey=PeerID.from_base58(victim_id).to_bytes(),
            ),
        }
    finally:
        raw.shutdown()
        forger.shutdown()


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    process = ManagedProcess("seed", ["seed"], tmp_path_factory.mktemp("seed") / "seed.log")
    try:
        yield [process.wait_for(READY_PREFIX, 120).split()[-1]]
    finally:
        process.stop()


def test_a_seed_refuses_every_forged_record_and_keeps_honest_ones(seed, tmp_path: Path):
    auth_key = generate_signing_key()
    victim, victim_validator = create_signed_dht(
        tmp_path / "victim.id", RSAPrivateKey(), initial_peers=seed, host_maddrs=LOOPBACK, client_mode=True
    )
    raw_reader = client(seed)  # sees whatever the seed kept (signed values it cannot decode: those need a validator)
    reader = client(seed, record_validators=record_validators())
    try:
        accepted = forgeries(victim, victim_validator, seed, auth_key)
        assert not any(accepted.values()), f"the seed stored: {[name for name, ok in accepted.items() if ok]}"
        assert raw_reader.get(VERDICTS_KEY, latest=True) is None
        assert raw_reader.get("agora.progress.body1_progress", latest=True) is None

        # The victim's own signed records and a well-formed roster entry are kept.
        victim_id = victim.peer_id.to_base58()
        assert publish_metrics(victim, active_metrics(victim_id, auth_key), victim_validator, TTL)
        assert announce(victim, WorkerRecord(uid="body1.0.0", peer_id=victim_id, stage="body1"), TTL)
        stored = reader.get(metrics_key("body1"), latest=True).value
        assert list(stored) == [metrics_subkey(victim_id, victim_validator)]
        assert list(fetch_roster(raw_reader, "body1")) == [victim_id]
        assert len(raw_reader.get(roster_key("body1"), latest=True).value) == 1  # the malformed entries are not there
    finally:
        raw_reader.shutdown()
        reader.shutdown()
        victim.shutdown()


def test_a_seed_without_the_validators_stores_the_same_forgeries(tmp_path: Path):
    """The control: hivemind's defaults accept these writes, so the test above can fail."""
    bare_seed = DHT(start=True, host_maddrs=LOOPBACK)
    seeds = [str(addr) for addr in bare_seed.get_visible_maddrs()]
    victim, victim_validator = create_signed_dht(
        tmp_path / "victim.id", RSAPrivateKey(), initial_peers=seeds, host_maddrs=LOOPBACK, client_mode=True
    )
    try:
        accepted = forgeries(victim, victim_validator, seeds, generate_signing_key())
        assert all(accepted.values()), f"refused even without validators: {[n for n, ok in accepted.items() if not ok]}"
    finally:
        victim.shutdown()
        bare_seed.shutdown()


def verdict_of(validator: RSASignatureValidator, ticket: str, worker: str, uid: str = "body1.0.1") -> Verdict:
    """The trainer that signs with ``validator`` names ``worker`` caught lying."""
    return Verdict(
        trainer=trainer_peer_id(validator),
        ticket=ticket,
        peer_id=worker,
        uid=uid,
        stage=uid.split(".")[0],
        checks=4,
        disagreements=3,
        ts=get_dht_time(),
    )


def test_the_monitor_keeps_only_verdicts_of_ticketed_trainers(seed):
    auth_key = generate_signing_key()
    worker_id = "12D3KooWworker"
    honest = RSASignatureValidator(RSAPrivateKey())
    stranger = RSASignatureValidator(RSAPrivateKey())
    worker_ticket = issue_ticket(
        auth_key, identity="bob", peer_id=trainer_peer_id(stranger), stage="body1", slot=0, ttl_s=60
    )
    other_service = trainer_ticket(generate_signing_key(), stranger)
    nodes = [client(seed, record_validators=record_validators(key._private_key)) for key in (honest, stranger)]
    monitor = client(seed, record_validators=record_validators())
    try:
        assert publish_verdict(nodes[0], verdict_of(honest, trainer_ticket(auth_key, honest), worker_id), honest, TTL)
        # Signed and well-formed, so the DHT keeps them; the monitor drops them for their tickets.
        assert publish_verdict(nodes[1], verdict_of(stranger, worker_ticket, worker_id), stranger, TTL)
        assert publish_verdict(nodes[1], verdict_of(stranger, other_service, "12D3KooWother"), stranger, TTL)
        rejected: list[str] = []
        found = fetch_verdicts(monitor, public_key_text(auth_key), on_reject=rejected.append)
        assert [(v.trainer, v.peer_id) for v in found] == [(trainer_peer_id(honest), worker_id)]
        assert any("/ stage body1, not" in reason for reason in rejected), rejected  # a worker's ticket
        assert any("invalid ticket in verdict" in reason for reason in rejected), rejected
    finally:
        monitor.shutdown()
        for node in nodes:
            node.shutdown()


def test_a_trainer_routes_to_no_worker_a_ticketed_trainer_caught(seed):
    """A trainer started after another's verdict (or restarted after its own) keeps the liar out of routing from its
    first roster read, in every stage the liar serves; a verdict signed without a trainer ticket changes nothing."""
    auth_key = generate_signing_key()
    caught, honest_worker, accused = "12D3KooWcaught", "12D3KooWhonest", "12D3KooWaccused"
    trainer = RSASignatureValidator(RSAPrivateKey())
    stranger = RSASignatureValidator(RSAPrivateKey())
    signers = {key: client(seed, record_validators=record_validators(key._private_key)) for key in (trainer, stranger)}
    reader = client(seed, record_validators=record_validators())
    said: list[tuple[str, str]] = []
    try:
        assert publish_verdict(
            signers[trainer], verdict_of(trainer, trainer_ticket(auth_key, trainer), caught, "tail.0.0"), trainer, TTL
        )
        assert publish_verdict(signers[stranger], verdict_of(stranger, "not a ticket", accused), stranger, TTL)
        for worker, uid in ((caught, "tail.0.0"), (honest_worker, "tail.0.1"), (accused, "tail.0.2")):
            assert announce(reader, WorkerRecord(uid=uid, peer_id=worker, stage="tail"), TTL)
        assert announce(reader, WorkerRecord(uid="head.0.0", peer_id=caught, stage="head"), TTL)  # moved on

        router = Router(["tail", "head"])
        watcher = RosterWatcher(
            {"tail": reader, "head": reader},
            router,
            period=60,
            stop=threading.Event(),
            say=lambda tag, message: said.append((tag, message)),
            auth_public_key=public_key_text(auth_key),
        )
        watcher.refresh()
        assert watcher.known == {"tail": {"tail.0.1", "tail.0.2"}, "head": set()}
        assert router["tail"].stats().workers == 2 and router.empty_stages() == ["head"]
        assert sum(f"keeping tail.0.0 (peer {caught}) out of routing" in message for _, message in said) == 1

        without_key = Router(["tail", "head"])  # no key to verify verdicts with: every worker is routed to
        RosterWatcher(
            {"tail": reader, "head": reader}, without_key, 60, threading.Event(), lambda *said: None, None
        ).refresh()
        assert without_key["tail"].stats().workers == 3 and without_key.empty_stages() == []
    finally:
        reader.shutdown()
        for node in signers.values():
            node.shutdown()


def test_the_monitor_keeps_only_receipts_of_ticketed_trainers(seed):
    auth_key = generate_signing_key()

    def receipt_of(validator: RSASignatureValidator, ticket: str) -> Receipt:
        served = {"12D3KooWworker": ServedCounts(stage="body1", forwards=2, backwards=1, flops=3e12)}
        return Receipt(trainer=trainer_peer_id(validator), ticket=ticket, run_id="r1", served=served, ts=get_dht_time())

    honest = RSASignatureValidator(RSAPrivateKey())
    worker = RSASignatureValidator(RSAPrivateKey())  # a worker vouching for itself with its own (worker) ticket
    worker_ticket = issue_ticket(
        auth_key, identity="bob", peer_id=trainer_peer_id(worker), stage="body1", slot=0, ttl_s=60
    )
    nodes = [client(seed, record_validators=record_validators(key._private_key)) for key in (honest, worker)]
    monitor = client(seed, record_validators=record_validators())
    try:
        assert publish_receipt(nodes[0], receipt_of(honest, trainer_ticket(auth_key, honest)), honest, TTL)
        assert publish_receipt(nodes[1], receipt_of(worker, worker_ticket), worker, TTL)  # signed: the DHT keeps it
        rejected: list[str] = []
        found = fetch_receipts(monitor, public_key_text(auth_key), on_reject=rejected.append)
        assert [(r.trainer, r.served["12D3KooWworker"].flops) for r in found] == [(trainer_peer_id(honest), 3e12)]
        assert any("receipt" in reason and "/ stage body1, not" in reason for reason in rejected), rejected
    finally:
        monitor.shutdown()
        for node in nodes:
            node.shutdown()
