"""Receipts: a trainer counts what each worker served it with the worker's own FLOP formula, and the monitor
credits compute as the lesser of a worker's claim and its receipts (the DHT side: test_dht_validation.py)."""

from __future__ import annotations

import pytest
import torch

from agora_client.config import load_config
from agora_client.discovery.signed_records import Receipt, ServedCounts
from agora_client.monitor.points import PFLOP, Observation, PointsPolicy
from agora_client.monitor.store import PointsStore
from agora_client.trainer.receipts import ReceiptBook
from agora_client.worker.metrics import WorkerMetrics

POLICY = PointsPolicy(identity_cap=2, online_window_s=90.0)


def _claim(peer: str, t: float, flops: float, identity: str) -> Observation:
    return Observation(
        peer_id=peer,
        identity=identity,
        stage="body1",
        run_id="r1",
        sync_phase="active",
        active_seconds=t,
        compute_flops=flops,
        seen_at=t,
        published_at=t,
        swarm_phase="active",
    )


def _receipt(trainer: str, run_id: str, **flops_by_peer: float) -> Receipt:
    served = {
        peer: ServedCounts(stage="body1", forwards=1, backwards=1, flops=flops) for peer, flops in flops_by_peer.items()
    }
    return Receipt(trainer=trainer, ticket="checked by monitor/receipts.py", run_id=run_id, served=served, ts=0.0)


def test_a_trainer_prices_each_request_as_the_worker_does():
    model = load_config("tiny").model
    book = ReceiptBook(model)
    worker = WorkerMetrics(model, "body1", peer_id="QmBody", identity="alice", ticket="t")
    worker.set_phase("active")
    tokens = torch.zeros(3, 17, dtype=torch.long)
    boundary = torch.zeros(3, 17, model.d_model)
    claimed = worker.on_forward(tokens) + worker.on_backward(tokens) + worker.on_backward(tokens)
    book.count("body1", "forward", "QmBody", (boundary, tokens))
    for _ in range(2):
        book.count("body1", "backward", "QmBody", (boundary, tokens))
    book.count("head", "forward", "QmHead", (tokens,))
    receipt = book.receipt("QmTrainer", "ticket", now=5.0)
    assert receipt.served["QmBody"] == ServedCounts(stage="body1", forwards=1, backwards=2, flops=claimed)
    assert receipt.served["QmHead"].forwards == 1 and receipt.served["QmHead"].flops > 0
    assert (receipt.trainer, receipt.run_id, receipt.ts) == ("QmTrainer", book.run_id, 5.0)


def test_a_worker_claiming_ten_times_its_flops_earns_no_more_than_an_honest_one_and_is_flagged(tmp_path):
    store = PointsStore(tmp_path / "points.sqlite", POLICY)
    served = 4 * PFLOP
    store.record_scrape([_claim("honest", 0, 0, "alice"), _claim("inflated", 0, 0, "bob")], {}, now=0)
    store.record_receipts([_receipt("QmTrainer", "run1", honest=served, inflated=served)])
    store.record_scrape([_claim("honest", 60, served, "alice"), _claim("inflated", 60, 10 * served, "bob")], {}, now=60)
    honest, inflated = store.peer("honest"), store.peer("inflated")
    assert inflated.compute_points == pytest.approx(honest.compute_points) == pytest.approx(4.0)
    assert inflated.claimed_points == pytest.approx(40.0)
    assert inflated.over_claimed(POLICY) and not honest.over_claimed(POLICY)
    rows = {row.username: row for row in store.leaderboard(now=60)}
    assert rows["bob"].score == pytest.approx(rows["alice"].score) and rows["bob"].flagged and not rows["alice"].flagged
    store.close()


def test_receipts_of_two_trainers_and_of_a_restarted_trainer_add_up_and_a_reread_counts_once(tmp_path):
    db = tmp_path / "points.sqlite"
    store = PointsStore(db, POLICY)
    store.record_scrape([_claim("w", 0, 0, "alice")], {}, now=0)
    store.record_scrape([_claim("w", 60, 10 * PFLOP, "alice")], {}, now=60)
    store.record_receipts([_receipt("QmA", "a1", w=2 * PFLOP), _receipt("QmB", "b1", w=3 * PFLOP)])
    assert store.peer("w").compute_points == pytest.approx(5.0)
    store.record_receipts([_receipt("QmA", "a1", w=2 * PFLOP), _receipt("QmA", "a1", w=1 * PFLOP)])  # no growth
    assert store.peer("w").compute_points == pytest.approx(5.0)
    store.close()
    store = PointsStore(db, POLICY)  # the monitor restarted; trainer A restarted too: its counters begin again
    store.record_receipts([_receipt("QmA", "a2", w=4 * PFLOP)])
    assert store.peer("w").compute_points == pytest.approx(9.0) and store.peer("w").receipted_flops == 9 * PFLOP
    store.close()


def test_a_claim_within_its_receipts_is_credited_as_claimed_and_a_withheld_peer_earns_no_compute(tmp_path):
    store = PointsStore(tmp_path / "points.sqlite", POLICY)
    store.record_scrape([_claim("w", 0, 0, "alice")], {}, now=0)
    store.record_scrape([_claim("w", 60, 2 * PFLOP, "alice")], {}, now=60)
    store.record_receipts([_receipt("QmA", "a1", w=3 * PFLOP)])  # receipts may run ahead (phase-1 requests count)
    assert store.peer("w").compute_points == pytest.approx(2.0)
    store.withhold("w", "caught", now=61)
    assert store.peer("w").compute_points == 0.0 and store.peer("w").claimed_points == pytest.approx(2.0)
    store.close()
