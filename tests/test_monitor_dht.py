"""Signed metrics on real hivemind DHT nodes (127.0.0.1) and the monitor service as a real process.

Forged records sit in the same DHT key as the real ones the whole time; the monitor's totals must
equal exactly what the honest workers' counters say (a ticketed trainer's receipts vouch for that work). Validating
nodes refuse unsigned and badly signed entries at write time, so those reach a reader only through a permissive node
near the key. The monitor's scraper also keeps the trainers' (unsigned) loss and eval-loss points, each once.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth.tickets import generate_signing_key, issue_ticket, public_key_text
from agora_client.config import load_config
from agora_client.discovery.roster import WorkerRecord, announce, stage_uid
from agora_client.discovery.signed_records import Receipt, ServedCounts
from agora_client.engine.identity import write_identity_file
from agora_client.monitor.estimate import fetch_confirmed
from agora_client.monitor.http_api import LeaderboardServer
from agora_client.monitor.points import PFLOP
from agora_client.monitor.records import (
    MetricsRecord,
    check_entry,
    create_signed_dht,
    fetch_metrics,
    metrics_key,
    metrics_subkey,
    publish_metrics,
    signed_dht_kwargs,
)
from agora_client.monitor.scraper import Scraper
from agora_client.monitor.store import PointsStore
from agora_client.monitor.verdicts import trainer_peer_id
from agora_client.trainer.progress import ProgressPublisher
from agora_client.trainer.receipts import ReceiptBook, publish_receipt
from agora_client.worker.metrics import WorkerMetrics
from tests.ticket_helpers import trainer_ticket

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MODEL = load_config("tiny").model
TTL = 300.0

pytestmark = pytest.mark.integration


def announce_active(dht: DHT, metrics: WorkerMetrics) -> None:
    """The worker's roster entry, active: the phase the monitor checks a record's claim against."""
    record = WorkerRecord(uid=stage_uid(metrics.stage, 0), peer_id=metrics.peer_id, stage=metrics.stage, sync_phase=0)
    assert announce(dht, record, TTL)


class ForgingValidator(RSASignatureValidator):
    """An attacker's validator: signs every record with its own key and accepts anything."""

    def sign_value(self, record):
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)

    def validate(self, record) -> bool:
        return True


class Swarm:
    def __init__(self, tmp: Path) -> None:
        self.dhts: list[DHT] = []
        self.auth_key = generate_signing_key()
        self.public_key = public_key_text(self.auth_key)
        self.seed = self._keep(
            DHT(start=True, host_maddrs=LOOPBACK, record_validators=[RSASignatureValidator(RSAPrivateKey())])
        )
        self.initial_peers = [str(addr) for addr in self.seed.get_visible_maddrs()]
        self.alice_body, self.alice_body_validator = self._signed(tmp / "alice-body.id")
        self.alice_head, self.alice_head_validator = self._signed(tmp / "alice-head.id")
        self.mallory, self.mallory_validator = self._signed(tmp / "mallory.id")
        self.trainer, self.trainer_validator = self._signed(tmp / "trainer.id")  # receipts vouch for the work
        self.unsigned = self._keep(DHT(start=True, initial_peers=self.initial_peers, host_maddrs=LOOPBACK))
        self.forger = self._keep(
            DHT(
                start=True,
                initial_peers=self.initial_peers,
                host_maddrs=LOOPBACK,
                record_validators=[ForgingValidator(RSAPrivateKey())],
            )
        )
        self.monitor = self._keep(
            DHT(
                start=True,
                initial_peers=self.initial_peers,
                client_mode=True,
                record_validators=[RSASignatureValidator(RSAPrivateKey())],
            )
        )

    def _keep(self, dht: DHT) -> DHT:
        self.dhts.append(dht)
        return dht

    def _signed(self, path: Path) -> tuple[DHT, RSASignatureValidator]:
        dht, validator = create_signed_dht(
            path, RSAPrivateKey(), initial_peers=self.initial_peers, host_maddrs=LOOPBACK
        )
        return self._keep(dht), validator

    def ticket(self, dht: DHT, stage: str, identity: str = "alice") -> str:
        return issue_ticket(
            self.auth_key, identity=identity, peer_id=dht.peer_id.to_base58(), stage=stage, slot=0, ttl_s=3600
        )

    def shutdown(self) -> None:
        for dht in reversed(self.dhts):
            dht.shutdown()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    built = Swarm(tmp_path_factory.mktemp("dht"))
    try:
        yield built
    finally:
        built.shutdown()


def worker_metrics(swarm: Swarm, dht: DHT, stage: str) -> WorkerMetrics:
    metrics = WorkerMetrics(
        MODEL, stage, peer_id=dht.peer_id.to_base58(), identity="alice", ticket=swarm.ticket(dht, stage)
    )
    metrics.set_phase("active")
    return metrics


def plant_forgeries(swarm: Swarm, victim: MetricsRecord, victim_validator: RSASignatureValidator) -> None:
    """Every way we know to claim points that were not earned, stored next to the real record."""
    inflated = victim.model_copy(update={"compute_flops": 1e21, "flops_total": 1e21}).model_dump(mode="json")
    key, expiration = metrics_key(victim.stage), get_dht_time() + TTL
    mallory_id = swarm.mallory.peer_id.to_base58()
    # 1. unsigned: the victim's peer id as a bare subkey
    swarm.unsigned.store(key, inflated, expiration, subkey=victim.peer_id.encode())
    # 2. the victim's owner subkey, signed with another key
    swarm.forger.store(key, inflated, expiration, subkey=metrics_subkey(victim.peer_id, victim_validator))
    # 3. correctly signed by mallory, but claiming to be the victim's peer
    swarm.mallory.store(key, inflated, expiration, subkey=metrics_subkey(victim.peer_id, swarm.mallory_validator))
    # 4. mallory's own peer, replaying the victim's ticket
    replay = victim.model_copy(update={"peer_id": mallory_id, "compute_flops": 1e21})
    assert publish_metrics(swarm.mallory, replay, swarm.mallory_validator, TTL)
    # 5. mallory's own peer with a ticket from another auth service (for the head stage, not taken by anyone)
    other_service = generate_signing_key()
    fake_ticket = issue_ticket(other_service, identity="mallory", peer_id=mallory_id, stage="head", slot=0, ttl_s=3600)
    fake = victim.model_copy(
        update={
            "peer_id": mallory_id,
            "identity": "mallory",
            "stage": "head",
            "ticket": fake_ticket,
            "compute_flops": 1e21,
        }
    )
    assert publish_metrics(swarm.mallory, fake, swarm.mallory_validator, TTL)


def test_fetch_keeps_the_signed_ticketed_record_and_drops_every_forgery(swarm):
    metrics = worker_metrics(swarm, swarm.alice_body, "body1")
    metrics.on_backward((8, 128))
    real = metrics.snapshot()
    assert publish_metrics(swarm.alice_body, real, swarm.alice_body_validator, TTL)
    plant_forgeries(swarm, real, swarm.alice_body_validator)

    rejected: list[str] = []
    found = fetch_metrics(swarm.monitor, ["head", "body1"], swarm.public_key, on_reject=rejected.append)
    assert [item.record for item in found] == [real]
    assert found[0].claims.identity == "alice" and found[0].claims.peer_id == real.peer_id
    reasons = "\n".join(rejected)
    assert "is signed by the key of peer" in reasons
    assert "ticket is for peer" in reasons
    assert "invalid ticket" in reasons
    # The raw DHT value really holds the planted entries: the monitor saw them and dropped them.
    raw = swarm.monitor.get(metrics_key("body1"), latest=True).value
    assert len(raw) >= 3


def test_an_unsigned_entry_is_refused_whatever_node_kept_it(swarm):
    """A permissive node near the key may hand the monitor a bare-subkey entry: the monitor drops it itself."""
    metrics = worker_metrics(swarm, swarm.alice_body, "body1")
    record = metrics.snapshot().model_dump(mode="json")
    with pytest.raises(ValueError, match="unsigned record"):
        check_entry("body1", record["peer_id"].encode(), record, swarm.public_key)
    with pytest.raises(ValueError, match="unsigned record"):
        check_entry("body1", record["peer_id"], record, swarm.public_key)
    signed = metrics_subkey(record["peer_id"], swarm.alice_body_validator)
    assert check_entry("body1", signed, record, swarm.public_key)[0].peer_id == record["peer_id"]


class MonitorProcess:
    def __init__(self, swarm: Swarm, db: Path) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "agora_cli.py"),
                "monitor",
                "--initial-peers",
                *swarm.initial_peers,
                "--auth-public-key",
                swarm.public_key,
                "--db",
                str(db),
                "--port",
                "0",
                "--interval",
                "1",
                "--log-level",
                "WARNING",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_for_url(timeout=90)

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            seen.append(line)
            if line.startswith("[MONITOR] leaderboard on "):
                return line.removeprefix("[MONITOR] leaderboard on ").strip().removesuffix("/leaderboard")
        raise AssertionError("monitor did not start:\n" + "".join(seen))

    def kill(self) -> None:
        """SIGKILL the monitor and its DHT children (its own process group): a crash, not a clean stop."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def wait_for(predicate, timeout: float = 60.0, message: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out: {message}")


def peer_compute(url: str, peer_id: str) -> float | None:
    reply = httpx.get(f"{url}/peers/{peer_id}", timeout=5)
    return reply.json()["compute"] if reply.status_code == 200 else None


def test_monitor_killed_mid_run_keeps_every_total_and_never_counts_forgeries(swarm, tmp_path):
    body = worker_metrics(swarm, swarm.alice_body, "body1")
    head = worker_metrics(swarm, swarm.alice_head, "head")
    started = time.time()

    def work_and_publish(batches: int) -> None:
        for _ in range(batches):
            body.on_backward((8, 128))
            head.on_backward((8, 128))
        assert publish_metrics(swarm.alice_body, body.snapshot(), swarm.alice_body_validator, TTL)
        assert publish_metrics(swarm.alice_head, head.snapshot(), swarm.alice_head_validator, TTL)
        announce_active(swarm.alice_body, body)
        announce_active(swarm.alice_head, head)
        served = {
            metrics.peer_id: ServedCounts(
                stage=metrics.stage, forwards=0, backwards=metrics.batches, flops=metrics.flops_total
            )
            for metrics in (body, head)
        }
        receipt = Receipt(
            trainer=trainer_peer_id(swarm.trainer_validator),
            run_id="trainer-run-1",
            served=served,
            ticket=trainer_ticket(swarm.auth_key, swarm.trainer_validator),
            ts=time.time(),
        )
        assert publish_receipt(swarm.trainer, receipt, swarm.trainer_validator)

    work_and_publish(3)
    plant_forgeries(swarm, body.snapshot(), swarm.alice_body_validator)
    body_id, head_id = (dht.peer_id.to_base58() for dht in (swarm.alice_body, swarm.alice_head))
    db = tmp_path / "points.sqlite"

    monitor = MonitorProcess(swarm, db)
    try:
        expected = (body.compute_flops / PFLOP, head.compute_flops / PFLOP)
        wait_for(
            lambda: (peer_compute(monitor.url, body_id), peer_compute(monitor.url, head_id)) == pytest.approx(expected),
            message="first run of the monitor never credited both peers",
        )
    finally:
        monitor.kill()

    work_and_publish(5)  # the swarm goes on while the monitor is down
    monitor = MonitorProcess(swarm, db)
    try:
        expected = (body.compute_flops / PFLOP, head.compute_flops / PFLOP)
        wait_for(
            lambda: (peer_compute(monitor.url, body_id), peer_compute(monitor.url, head_id)) == pytest.approx(expected),
            message="restarted monitor did not reach the workers' totals",
        )
        time.sleep(2.5)  # a few more scrapes of the same records change nothing
        rows = httpx.get(f"{monitor.url}/leaderboard", timeout=5).json()["rows"]
    finally:
        monitor.kill()

    assert [row["username"] for row in rows] == ["alice"]  # mallory's records never counted
    alice = rows[0]
    compute = (body.compute_flops + head.compute_flops) / PFLOP
    presence_hours = alice["active_hours"]
    assert 0 < presence_hours <= 2 * (time.time() - started) / 3600 + 1e-3
    assert alice["score"] == pytest.approx(compute + presence_hours, abs=1e-4)
    assert alice["online"] is True


def test_a_signed_worker_dht_keeps_the_progress_tracker_working(swarm, tmp_path):
    """signed_dht_kwargs uses hivemind's process-wide key, so ProgressTracker's default validator agrees with it."""
    from hivemind.optim.progress_tracker import ProgressTracker

    kwargs = signed_dht_kwargs(tmp_path / "worker.id")
    dht = DHT(start=True, initial_peers=swarm.initial_peers, host_maddrs=LOOPBACK, **kwargs)
    tracker = None
    try:
        assert dht.peer_id.to_base58() == write_identity_file(tmp_path / "again.id")
        tracker = ProgressTracker(
            dht,
            "agora.progress.test",
            target_batch_size=100,
            start=True,
            min_refresh_period=0.2,
            max_refresh_period=0.5,
            default_refresh_period=0.2,
        )
        tracker.report_local_progress(0, 40)
        wait_for(lambda: tracker.global_progress.samples_accumulated == 40, timeout=30, message="progress not reported")
        metrics = worker_metrics(swarm, dht, "body2")
        assert publish_metrics(dht, metrics.snapshot(), kwargs["record_validators"][0], TTL)
        found = fetch_metrics(swarm.monitor, ["body2"], swarm.public_key)
        assert [item.record.peer_id for item in found] == [dht.peer_id.to_base58()]
    finally:
        if tracker is not None:
            tracker.shutdown()
        dht.shutdown()


def test_each_scrape_keeps_the_trainers_loss_and_eval_points_once(swarm, tmp_path):
    trainer = ProgressPublisher(swarm.unsigned, ttl=TTL)
    assert trainer.publish(4, 5.0, 100.0, eval_loss=5.3, eval_at=1000.0)
    assert trainer.publish(8, 4.7, 100.0, eval_loss=5.3, eval_at=1000.0)  # the same evaluation, reported again
    store = PointsStore(tmp_path / "points.sqlite")
    scraper = Scraper(swarm.monitor, ["head"], store, swarm.public_key)
    try:
        wait_for(
            lambda: scraper.scrape_once() is not None and len(store.learning()["loss"]) == 2,
            timeout=30,
            message="the scraper never stored the trainer's two loss points",
        )
        scraper.scrape_once()  # the same record read again adds nothing
        curves = store.learning()
    finally:
        store.close()
    assert [loss for _, loss in curves["loss"]] == [5.0, 4.7]
    assert curves["eval_loss"] == [(1000.0, 5.3)]


def test_a_worker_signing_ten_times_its_flops_earns_no_more_than_an_honest_one_serving_the_same(swarm, tmp_path):
    """Both workers hold genuine tickets and sign their records; one claims 10x what it computed. A ticketed trainer
    receipts what each served it (the same requests); the monitor's scrape credits both alike and flags the liar,
    and the liar's own client hears it from the monitor's API."""
    honest_dht, honest_validator = swarm._signed(tmp_path / "honest.id")
    liar_dht, liar_validator = swarm._signed(tmp_path / "liar.id")
    book = ReceiptBook(MODEL)
    requests = (torch.zeros(8, 128, MODEL.d_model), torch.zeros(8, 128, dtype=torch.long))
    workers = {}
    for dht, validator, identity in ((honest_dht, honest_validator, "carol"), (liar_dht, liar_validator, "dave")):
        metrics = WorkerMetrics(
            MODEL,
            "tail",
            peer_id=dht.peer_id.to_base58(),
            identity=identity,
            ticket=swarm.ticket(dht, "tail", identity),
        )
        metrics.set_phase("active")
        for _ in range(200):  # enough that a 10x claim is past the monitor's slack
            metrics.on_backward((8, 128))
            book.count("tail", "backward", metrics.peer_id, requests)
        record = metrics.snapshot()
        if identity == "dave":
            record = record.model_copy(
                update={"compute_flops": 10 * record.compute_flops, "flops_total": 10 * record.flops_total}
            )
        assert publish_metrics(dht, record, validator, TTL)
        announce_active(dht, metrics)
        workers[identity] = record
    trainer = trainer_peer_id(swarm.trainer_validator)
    assert publish_receipt(
        swarm.trainer,
        book.receipt(trainer, trainer_ticket(swarm.auth_key, swarm.trainer_validator)),
        swarm.trainer_validator,
    )

    store = PointsStore(tmp_path / "points.sqlite")
    scraper = Scraper(swarm.monitor, ["tail"], store, swarm.public_key)
    honest_id, liar_id = workers["carol"].peer_id, workers["dave"].peer_id
    server = LeaderboardServer(store).start()
    try:
        wait_for(
            lambda: (
                scraper.scrape_once() is not None
                and all(
                    (peer := store.peer(peer_id)) is not None and peer.receipted_flops > 0
                    for peer_id in (honest_id, liar_id)
                )
            ),
            timeout=30,
            message="the scrape never credited both workers against the trainer's receipt",
        )
        honest, liar = store.peer(honest_id), store.peer(liar_id)
        rows = {row.username: row for row in store.leaderboard(time.time())}
        heard = fetch_confirmed(server.url, liar_id)
    finally:
        server.stop()
        store.close()
        for dht in (liar_dht, honest_dht):
            dht.shutdown()
            swarm.dhts.remove(dht)
    served = workers["carol"].compute_flops / PFLOP
    assert honest.compute_points == pytest.approx(served) == pytest.approx(liar.compute_points)
    assert liar.claimed_points == pytest.approx(10 * served)
    assert rows["dave"].flagged and not rows["carol"].flagged
    assert rows["dave"].score == pytest.approx(rows["carol"].score, abs=1e-3)  # presence: moments apart
    assert (
        heard.flagged
        and heard.verified_compute == pytest.approx(served)
        and heard.claimed_compute == pytest.approx(10 * served)
    )
