"""Spot checks (agora_client.trainer.spotcheck) against stage clients that compute in-process, and the
monitor's withholding of a caught worker's compute points."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agora_client.config import SpotCheckConfig
from agora_client.discovery.roster import WorkerRecord
from agora_client.monitor.points import PFLOP, Observation, PointsPolicy
from agora_client.monitor.store import PointsStore
from agora_client.trainer.balancer import Router
from agora_client.trainer.spotcheck import SpotChecker, relative_distance

STAGE = "body1"


class Replicas:
    """A StageClient stand-in: each worker applies its own weights; liars answer random tensors of the right shape
    and scale."""

    def __init__(self, weights: dict[str, torch.Tensor], liars: set[str] = frozenset(), down: set[str] = frozenset()):
        self.weights, self.liars, self.down = weights, liars, down
        self.calls: list[tuple[str, str]] = []

    def _answer(self, worker: WorkerRecord, kind: str, value: torch.Tensor) -> list[torch.Tensor]:
        self.calls.append((worker.uid, kind))
        if worker.uid in self.down:
            raise ConnectionResetError(f"{worker.uid} is unreachable")
        return [torch.randn_like(value) * value.std()] if worker.uid in self.liars else [value]

    def forward(self, worker, inputs):
        return self._answer(worker, "forward", inputs[0] @ self.weights[worker.uid])

    def backward(self, worker, inputs, grad_outputs):
        return self._answer(worker, "backward", grad_outputs[0] @ self.weights[worker.uid].T)


def swarm(
    count: int, *, drift: float = 0.01, liars=(), down=(), dim: int = 16
) -> tuple[Router, Replicas, list[WorkerRecord]]:
    torch.manual_seed(0)
    base = torch.randn(dim, dim)
    records = [WorkerRecord(uid=f"{STAGE}.0.{i}", peer_id=f"peer{i}", stage=STAGE) for i in range(count)]
    router = Router([STAGE])
    router.update_roster(records)
    weights = {r.uid: base + drift * torch.randn(dim, dim) for r in records}  # replicas SPARTA keeps close, not equal
    return router, Replicas(weights, set(liars), set(down)), records


def check(checker: SpotChecker, client: Replicas, worker: WorkerRecord, kind: str = "forward") -> tuple[list, list]:
    """One request to ``worker`` as the pipeline makes it; returns (what the microbatch goes on with, the truth)."""
    dim = next(iter(client.weights.values())).shape[0]
    inputs = (torch.randn(4, dim),)
    grads = (torch.randn(4, dim),) if kind == "backward" else ()
    outputs = client.forward(worker, inputs) if kind == "forward" else client.backward(worker, inputs, grads)
    truth = inputs[0] @ client.weights[worker.uid] if kind == "forward" else grads[0] @ client.weights[worker.uid].T
    return checker.review(STAGE, kind, 64.0, worker, inputs, grads, outputs), [truth]


def test_relative_distance() -> None:
    a = torch.ones(3, 4)
    assert relative_distance([a], [a.clone()]) == 0.0
    assert relative_distance([a], [1.1 * a]) == pytest.approx(0.1)  # relative to the smaller answer
    assert relative_distance([a], [torch.ones(4, 3)]) == math.inf
    assert relative_distance([a], [a, a]) == math.inf
    assert relative_distance([a], [a * float("nan")]) == math.inf
    assert relative_distance([torch.zeros(2)], [torch.zeros(2)]) == 0.0
    assert relative_distance([a], [torch.zeros(3, 4)]) == math.inf


def test_an_answer_unrelated_to_the_truth_is_about_sqrt2_away_or_farther_at_any_scale() -> None:
    torch.manual_seed(0)
    truth = torch.randn(64, 256)
    for scale in (0.01, 0.3, 1.0, 3.0, 100.0):
        assert relative_distance([truth], [scale * torch.randn(64, 256)]) > 1.38


def calibrate(checker: SpotChecker, client: Replicas, workers: list[WorkerRecord], kind: str) -> None:
    """Checks on honest workers until the stage's ``kind`` requests are judged."""
    for index in range(100):
        if checker.report()[STAGE].model_dump()[kind]["state"] != "calibrating":
            return
        check(checker, client, workers[index % len(workers)], kind)
    raise AssertionError(f"{STAGE} {kind} still calibrating after 100 checks: {checker.report()[STAGE]}")


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_a_lying_worker_is_banned_after_strikes_checks_once_calibrated_and_its_answer_replaced(kind: str) -> None:
    router, client, records = swarm(3, liars={"body1.0.2"})
    named = []
    checker = SpotChecker(
        SpotCheckConfig(fraction=1.0, strikes=3), router, {STAGE: client}, on_ban=named.append, rng=random.Random(0)
    )
    liar, honest = records[2], records[0]
    # the liar may answer as second or third worker meanwhile: only the check that completes the calibration is
    # judged (with the tolerance it just made), and only the liar can be struck on it
    calibrate(checker, client, records[:2], kind)
    assert checker.report()[STAGE].model_dump()[kind]["state"] == "verifiable" and checker.stats.strikes <= 1
    assert named == []
    for _ in range(3):  # as many checks of its answers as the config's strikes: banned by the last at the latest
        answer, truth = check(checker, client, liar, kind)
        # the referee's honest answer replaces the lie: it is close to what the stage's weights compute
        assert relative_distance(answer, truth) < 0.3
    assert [(f.worker.uid, f.disagreements) for f in named] == [("body1.0.2", 3)]
    assert named[0].checks >= 3
    assert checker.stats.bans == 1 and checker.stats.resolved >= 3 and checker.report()[STAGE].bans == 1
    assert router[STAGE].stats().banned == 1
    lease = router[STAGE].choose("forward", exclude={honest.key, records[1].key})
    assert lease is None  # the liar takes no more requests from this trainer


def test_honest_replicas_are_never_struck() -> None:
    router, client, records = swarm(3, drift=0.02)
    named = []
    checker = SpotChecker(SpotCheckConfig(fraction=1.0, strikes=1), router, {STAGE: client}, on_ban=named.append)
    for index in range(60):
        check(checker, client, records[index % 3], "forward" if index % 2 else "backward")
    assert named == [] and checker.stats.checks == 60 and checker.stats.strikes == 0
    assert checker.stats.agreed >= 30  # once calibrated (a few checks of each kind), every check agrees
    assert checker.stats.agreed + checker.stats.unjudged == 60


def test_two_workers_cannot_calibrate_a_stage_so_their_disagreements_strike_nobody() -> None:
    router, client, records = swarm(2, liars={"body1.0.1"})
    named = []
    checker = SpotChecker(SpotCheckConfig(fraction=1.0, strikes=1), router, {STAGE: client}, on_ban=named.append)
    for _ in range(40):
        check(checker, client, records[0])
    assert named == [] and checker.stats.unjudged == 40 and checker.stats.calibrations == 0
    assert checker.report()[STAGE].forward.state == "calibrating"


def test_a_stage_drifted_too_far_to_judge_is_unverifiable_and_strikes_nobody() -> None:
    router, client, records = swarm(4, drift=3.0, liars={"body1.0.3"}, dim=64)  # honest replicas ~1.37 apart
    named, standings = [], []
    checker = SpotChecker(
        SpotCheckConfig(fraction=1.0, strikes=1),
        router,
        {STAGE: client},
        on_ban=named.append,
        on_standing=lambda stage, kind, standing: standings.append((stage, kind, standing.state)),
    )
    for index in range(60):
        check(checker, client, records[index % 4])
    assert named == [] and checker.stats.strikes == 0 and checker.stats.unjudged == 60
    assert standings == [(STAGE, "forward", "unverifiable")]
    assert checker.report()[STAGE].forward.tolerance >= math.sqrt(2) - checker.config.margin


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


def test_a_withheld_peer_loses_compute_earns_no_more_presence_and_stays_withheld_across_restarts(tmp_path) -> None:
    def obs(peer: str, t: float, flops: float) -> Observation:
        return Observation(
            peer_id=peer,
            identity=peer,
            stage=STAGE,
            run_id="r",
            sync_phase="active",
            active_seconds=t,
            compute_flops=flops,
            seen_at=t,
            published_at=t,
            swarm_phase="active",
        )

    store = PointsStore(tmp_path / "points.sqlite", PointsPolicy())
    assert store.withhold("liar", "caught by trainer t", now=0.0)  # named before the monitor ever saw it
    assert not store.withhold("liar", "again", now=1.0)
    store.record_scrape([obs("liar", 0, 0), obs("late", 0, 0)], {}, now=0)
    store.record_scrape([obs("liar", 60, 3 * PFLOP), obs("late", 60, PFLOP)], {}, now=60)
    assert store.withhold("late", "caught by trainer t", now=61.0)  # caught after a minute in its slot
    store.record_scrape([obs("liar", 120, 6 * PFLOP), obs("late", 120, 2 * PFLOP)], {}, now=120)
    liar, late = store.peer("liar"), store.peer("late")
    assert liar.withheld and liar.compute_points == 0.0 and liar.compute_flops == pytest.approx(6 * PFLOP)
    assert liar.score == 0.0  # withheld from its first sighting: its slot time earned nothing
    assert late.withheld and late.compute_points == 0.0 and late.score == pytest.approx(60 / 3600)  # before the catch
    store.close()
    reopened = PointsStore(tmp_path / "points.sqlite", PointsPolicy())
    reopened.record_scrape([obs("liar", 180, 9 * PFLOP), obs("late", 180, 3 * PFLOP)], {}, now=180)
    assert reopened.peer("liar").withheld and reopened.peer("late").withheld
    assert {row.username: row.score for row in reopened.leaderboard(now=180)} == pytest.approx(
        {"liar": 0.0, "late": 60 / 3600}, abs=1e-5
    )
    reopened.close()
