"""A stage's replica drift: the mean of its workers' latest SPARTA drift (before the update) over the metrics
records that have one; and where the trainer finds the key that verifies those records (a real auth service)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agora_client.auth.ticket_source import SelfIssuedTickets
from agora_client.auth.tickets import generate_signing_key, public_key_text
from agora_client.config import load_config
from agora_client.discovery.replica_drift import replica_drift
from agora_client.trainer.replica_drift import ReplicaDrifts, auth_public_key
from agora_client.worker.metrics import WorkerMetrics
from tests.test_auth import auth_service

MODEL = load_config("tiny").model


def record(peer: str, drift: tuple[float, float] | None):
    """A worker's metrics record after one SPARTA round that measured ``drift`` (None: no round has averaged)."""
    metrics = WorkerMetrics(MODEL, "body1", peer_id=peer, identity="alice", ticket="t")
    metrics.set_phase("active")
    if drift is not None:
        metrics.on_sparta_round(True, 1.0, *drift)
    return metrics.snapshot()


def test_the_drift_is_the_mean_of_the_records_drift_before_over_those_that_have_one():
    records = [record("a", (0.02, 0.001)), record("b", (0.05, 0.0)), record("c", None), record("d", (0.0, 0.0))]
    assert replica_drift(records) == pytest.approx((0.02 + 0.05 + 0.0) / 3)  # "after" does not count; c has none
    assert replica_drift([record("c", None)]) is None
    assert replica_drift([]) is None


def test_the_trainer_takes_the_key_of_its_own_tickets_or_asks_the_auth_service(tmp_path: Path):
    said: list[str] = []
    say = lambda tag, message: said.append(f"[{tag}] {message}")  # noqa: E731
    key = generate_signing_key()
    own = SelfIssuedTickets(key, role="trainer", stage="trainer")
    assert auth_public_key(own, "http://127.0.0.1:9", say) == public_key_text(key)  # no need to ask
    with auth_service(tmp_path) as (server, _):
        assert auth_public_key(None, server.url, say) == server.service.public_key
    assert said == []
    assert auth_public_key(None, None, say) is None  # no tickets at all: nothing to verify with, nothing said
    assert auth_public_key(None, "http://127.0.0.1:9", say) is None  # nothing listens on the discard port
    assert len(said) == 1 and "no parameter drift" in said[0] and "127.0.0.1:9" in said[0]


def test_without_the_key_the_trainer_reads_no_drift_and_does_not_touch_the_dht():
    said: list[str] = []
    drifts = ReplicaDrifts(None, ("head",), None, lambda tag, message: said.append(message))  # a read would fail
    assert drifts.read() == {} and said == []
