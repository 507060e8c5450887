"""Spot checks (agora_client.trainer.spotcheck) against stage clients that compute in-process, and the
monitor's withholding of a caught worker's compute points."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agora_client.config import SpotCheckConfig
from agora_client.monitor.points import PFLOP, Observation, PointsPolicy
from agora_client.monitor.store import PointsStore
from agora_client.discovery.roster import WorkerRecord
from agora_client.trainer.balancer import Router
from agora_client.trainer.spotcheck import SpotChecker, relative_distance

STAGE = "body1"


class Replicas:
    """A StageClient stand-in: each worker applies its own weights; liars answer random tensors of the right shape."""

    def __init__(self, weights: dict[str, torch.Tensor], liars: set[str] = frozenset(), down: set[str] = frozenset()):
        self.weights, self.liars, self.down = weights, liars, down
        self.calls: list[tuple[str, str]] = []

    def _answer(self, worker: WorkerRecord, kind: str, value: torch.Tensor) -> list[torch.Tensor]:
        self.calls.append((worker.uid, kind))
        if worker.uid in self.down:
            raise ConnectionResetError(f"{worker.uid} is unreachable")
        return [torch.randn_like(value)] if worker.uid in self.liars else [value]

    def forward(self, worker, inputs):
        return self._answer(worker, "forward", inputs[0] @ self.weights[worker.uid])

    def backward(self, worker, inputs, grad_outputs):
        return self._answer(worker, "backward", grad_outputs[0] @ self.weights[worker.uid].T)


def swarm(count: int, *, drift: float = 0.01, liars=(), down=()) -> tuple[Router, Replicas, list[WorkerRecord]]:
    torch.manual_seed(0)
    base = torch.randn(16, 16)
    records = [WorkerRecord(uid=f"{STAGE}.0.{i}", peer_id=f"peer{i}", stage=STAGE) for i in range(count)]
    router = Router([STAGE])
    router.update_roster(records)
    weights = {r.uid: base + drift * torch.randn(16, 16) for r in records}  # replicas SPARTA keeps close, not equal
    return router, Replicas(weights, set(liars), set(down)), records


def check(checker: SpotChecker, client: Replicas, worker: WorkerRecord, kind: str = "forward") -> tuple[list, list]:
    """One request to ``worker`` as the pipeline makes it; returns (what the microbatch goes on with, the truth)."""
    inputs = (torch.randn(4, 16),)
    grads = (torch.randn(4, 16),) if kind == "backward" else ()
    outputs = client.forward(worker, inputs) if kind == "forward" else client.backward(worker, inputs, grads)
    truth = inputs[0] @ client.weights[worker.uid] if kind == "forward" else grads[0] @ client.weights[worker.uid].T
    return checker.review(STAGE, kind, 64.0, worker, inputs, grads, outputs), [truth]


def test_relative_distance() -> None:
    a = torch.ones(3, 4)
    assert relative_distance([a], [a.clone()]) == 0.0
    assert relative_distance([a], [1.1 * a]) == pytest.approx(0.1 / 1.1)
    assert relative_distance([a], [torch.ones(4, 3)]) == math.inf
    assert relative_distance([a], [a, a]) == math.inf
    assert relative_distance([a], [a * float("nan")]) == math.inf
    assert relative_distance([torch.zeros(2)], [torch.zeros(2)]) == 0.0


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_lying_worker_is_struck_banned_and_named_and_its_answer_replaced(kind: str) -> None:
    router, client, records = swarm(3, liars={"body1.0.2"})
    named = []
    checker = SpotChecker(SpotCheckConfig(fraction=1.0, tolerance=0.3, strikes=3), router, {STAGE: client},
                          on_ban=named.append, rng=random.Random(0))
    liar, honest = records[2], records[0]
    for _ in range(3):
        answer, truth = check(checker, client, liar, kind)
        # the referee's honest answer replaces the lie: it is close to what the stage's weights compute
        assert relative_distance(answer, truth) < 0.3
    assert [(f.worker.uid, f.disagreements) for f in named] == [("body1.0.2", 3)]
    assert named[0].checks >= 3
    assert checker.stats.bans == 1 and checker.stats.resolved >= 3
    assert router[STAGE].stats().banned == 1
    lease = router[STAGE].choose("forward", exclude={honest.key, records[1].key})
    assert lease is None  # the liar takes no more requests from this trainer


def test_honest_replicas_within_the_tolerance_are_never_struck() -> None:
    router, client, records = swarm(3, drift=0.02)
    named = []
    checker = SpotChecker(SpotCheckConfig(fraction=1.0, strikes=1), router, {STAGE: client}, on_ban=named.append)
    for index in range(30):
        check(checker, client, records[index % 3], "forward" if index % 2 else "backward")
    assert named == [] and checker.stats.checks == 30 and checker.stats.agreed == 30


def test_a_disagreement_without_a_referee_strikes_nobody() -> None:
    router, client, records = swarm(2, liars={"body1.0.1"})
    named = []
    checker = SpotChecker(SpotCheckConfig(fraction=1.0, strikes=1), router, {STAGE: client}, on_ban=named.append)
    for _ in range(5):
        check(checker, client, records[0])
    assert named == [] and checker.stats.unresolved == 5


def test_a_stage_drifted_too_far_to_judge_strikes_nobody() -> None:
    router, client, records = swarm(3, drift=3.0)  # every replica far from every other
    named = []
    checker = SpotChecker(SpotCheckConfig(fraction=1.0, tolerance=0.3, strikes=1), router, {STAGE: client},
                          on_ban=named.append)
    for index in range(6):
        check(checker, client, records[index % 3])
    assert named == [] and checker.stats.unresolved == 6 and checker.stats.resolved == 0


def test_the_fraction_sets_how_many_requests_are_checked() -> None:
    router, client, records = swarm(2)
    checker = SpotChecker(SpotCheckConfig(fraction=0.1), router, {STAGE: client}, rng=random.Random(1))
    for _ in range(1000):
        check(checker, client, records[0])
    assert 60 <= checker.stats.checks <= 140
    off = SpotChecker(SpotCheckConfig(fraction=0.0), router, {STAGE: client})
    calls = len(client.calls)
    check(off, client, records[0])
    assert len(client.calls) == calls + 1  # only the request itself


def test_an_unreachable_checker_checks_nothing_and_the_balancer_learns_it() -> None:
    router, client, records = swarm(2, down={"body1.0.1"})
    checker = SpotChecker(SpotCheckConfig(fraction=1.0), router, {STAGE: client})
    outputs, truth = check(checker, client, records[0])
    assert relative_distance(outputs, truth) == 0.0 and checker.stats.checks == 0
    assert router[STAGE].stats().retries == 1


def test_a_withheld_peer_keeps_presence_loses_compute_and_stays_withheld_across_restarts(tmp_path) -> None:
    def obs(t: float, flops: float) -> Observation:
        return Observation(peer_id="liar", identity="mallory", stage=STAGE, run_id="r", sync_phase="active",
                           active_seconds=t, compute_flops=flops, seen_at=t)

    store = PointsStore(tmp_path / "points.sqlite", PointsPolicy())
    assert store.withhold("liar", "caught by trainer t", now=0.0)  # named before the monitor ever saw it
    assert not store.withhold("liar", "again", now=1.0)
    store.record_scrape([obs(0, 0)], {}, now=0)
    store.record_scrape([obs(60, 3 * PFLOP)], {}, now=60)
    peer = store.peer("liar")
    assert peer.withheld and peer.compute_points == 0.0 and peer.compute_flops == pytest.approx(3 * PFLOP)
    assert peer.score == pytest.approx(60 / 3600)
    store.close()
    reopened = PointsStore(tmp_path / "points.sqlite", PointsPolicy())
    assert reopened.peer("liar").withheld and reopened.leaderboard(now=60)[0].score == pytest.approx(60 / 3600, abs=1e-5)
    reopened.close()
