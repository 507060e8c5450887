"""Calibrated spot checks (agora_client.trainer.calibration): each stage's tolerance comes from distances between
answers known to be honest, so honest replicas that drift apart are not struck, and a liar still is."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from agora_client.config import ConfigError, SpotCheckConfig, parse_config
from agora_client.discovery.progress_records import TrainerProgress
from agora_client.trainer.calibration import Calibration, confirmed_distances
from agora_client.trainer.spotcheck import SpotChecker, relative_distance
from tests.test_spotcheck import STAGE, check, swarm

MARGIN = SpotCheckConfig().margin


def test_the_closest_pair_of_three_answers_is_honest_and_a_consistent_third_counts_too() -> None:
    assert confirmed_distances([0.5, 1.43, 1.45], MARGIN) == [0.5]  # a random answer: only the honest pair
    assert confirmed_distances([0.5, 0.6, 0.7], MARGIN) == [0.5, 0.6, 0.7]  # three honest answers
    assert confirmed_distances([0.2, 0.3, 0.9], MARGIN) == [0.2]  # a third far from the pair is not trusted
    assert confirmed_distances([0.5, math.inf, math.inf], MARGIN) == [0.5]  # the liar's answer had the wrong shape
    assert confirmed_distances([math.inf, math.inf, math.inf], MARGIN) == []


def test_a_calibration_is_judged_from_min_samples_on_a_quantile_plus_margin() -> None:
    config = SpotCheckConfig(min_samples=10, window=20, quantile=0.9, margin=0.1)
    calibration = Calibration(config)
    calibration.add([0.1 * i for i in range(1, 10)])
    assert calibration.standing().state == "calibrating" and calibration.standing().samples == 9
    assert calibration.wants_third_answer(random.Random(0))  # always, until calibrated
    calibration.add([1.0])
    standing = calibration.standing()
    assert standing.state == "verifiable" and standing.tolerance == pytest.approx(0.9 + 0.1)  # 9th of 10, plus margin
    calibration.add([1.3] * 20)  # the window keeps the newest 20: honest replicas now drift as far as random answers
    assert calibration.standing().state == "unverifiable" and calibration.standing().samples == 20
    calibrated = Calibration(config.model_copy(update={"calibration_share": 0.25}))
    calibrated.add([0.5] * 10)
    rng = random.Random(3)  # once calibrated, a share of checks asks a third worker
    assert 200 <= sum(calibrated.wants_third_answer(rng) for _ in range(1000)) <= 300


def test_a_config_whose_window_cannot_hold_min_samples_is_refused() -> None:
    with pytest.raises(ConfigError, match="min_samples .* must not exceed spot_checks.window"):
        parse_config(
            {
                "name": "r",
                "model": {
                    "vocab_size": 256,
                    "d_model": 64,
                    "n_heads": 4,
                    "n_layers": 2,
                    "seq_len": 16,
                    "stages": [{"name": "head", "layers": 1}, {"name": "tail", "layers": 1}],
                },
                "spot_checks": {"window": 20, "min_samples": 30},
            }
        )


def test_calibration_asks_a_third_worker_and_three_workers_are_enough() -> None:
    router, client, records = swarm(3, drift=0.05)
    standings = []
    config = SpotCheckConfig(fraction=1.0, min_samples=30, calibration_share=0.0)
    checker = SpotChecker(
        config,
        router,
        {STAGE: client},
        rng=random.Random(0),
        on_standing=lambda stage, kind, standing: standings.append((kind, standing.state)),
    )
    for index in range(10):  # three honest answers give three distances: ten checks calibrate
        before = len(client.calls)
        check(checker, client, records[index % 3])
        assert {uid for uid, _ in client.calls[before:]} == {
            r.uid for r in records
        }  # the request, the check, the third
    assert standings == [("forward", "verifiable")] and checker.stats.calibrations == 10
    before = len(client.calls)
    check(checker, client, records[0])
    assert len(client.calls) - before == 2  # calibrated, share 0: only the request and its check
    # the tenth check is judged on the distances it brought; the nine before it judged nobody
    assert (checker.stats.unjudged, checker.stats.agreed) == (9, 2) and checker.report()[STAGE].forward.tolerance < 0.3


def test_honest_drift_like_the_heads_never_strikes_after_calibration() -> None:
    router, client, records = swarm(3, drift=1.1, dim=64)
    named = []
    checker = SpotChecker(
        SpotCheckConfig(fraction=1.0, strikes=1), router, {STAGE: client}, on_ban=named.append, rng=random.Random(1)
    )
    distances = []
    for index in range(400):
        inputs = torch.randn(8, 64)
        answers = [inputs @ client.weights[r.uid] for r in records]
        distances += [relative_distance([a], [b]) for a, b in itertools.combinations(answers, 2)]
        check(checker, client, records[index % 3], "forward" if index % 4 else "backward")
    assert 0.85 < min(distances) and max(distances) < 1.35 and 1.0 < sum(distances) / len(distances) < 1.2  # the head's
    assert named == [] and checker.stats.strikes == 0
    report = checker.report()[STAGE]
    assert {report.forward.state, report.backward.state} <= {"verifiable", "unverifiable"}  # judged, or plainly not


def test_a_stage_whose_drift_grows_keeps_up_and_never_strikes_an_honest_worker() -> None:
    router, client, records = swarm(3, drift=0.0, dim=64)
    base = client.weights[records[0].uid].clone()
    directions = {r.uid: torch.randn(64, 64) for r in records}
    named = []
    checker = SpotChecker(
        SpotCheckConfig(fraction=1.0, strikes=1), router, {STAGE: client}, on_ban=named.append, rng=random.Random(2)
    )
    for index in range(600):
        drift = 0.3 + 0.4 * index / 600  # replicas ~0.35 apart at first, ~0.75 at the end, as bodies drift in training
        client.weights.update({uid: base + drift * direction for uid, direction in directions.items()})
        check(checker, client, records[index % 3])
    forward = checker.report()[STAGE].forward
    assert named == [] and checker.stats.strikes == 0
    assert forward.state == "verifiable" and 0.75 < forward.tolerance < math.sqrt(2) - MARGIN


def test_a_replica_that_lags_its_stage_and_drifts_twice_as_far_is_never_struck() -> None:
    """Two replicas close, the third three times as far from them as they stand apart (it missed averaging
    rounds), all drifting on: the lagging one's answers are beyond the tolerance and untrusted as samples, but
    within what drift can do, so they strike no one (with the tolerance alone they did, in a real swarm)."""
    router, client, records = swarm(3, drift=0.0, dim=64)
    base = client.weights[records[0].uid].clone()
    directions = {r.uid: torch.randn(64, 64) for r in records}
    reach = {records[0].uid: 1.0, records[1].uid: 3.0, records[2].uid: 1.0}
    strikes = []
    checker = SpotChecker(
        SpotCheckConfig(fraction=1.0, strikes=1),
        router,
        {STAGE: client},
        on_strike=strikes.append,
        rng=random.Random(3),
    )
    for index in range(600):
        drift = 0.1 + 0.2 * index / 600
        client.weights.update({uid: base + drift * reach[uid] * direction for uid, direction in directions.items()})
        check(checker, client, records[index % 3])
    report = checker.report()[STAGE]
    assert strikes == [] and report.bans == 0 and report.forward.state == "verifiable"
    assert checker.stats.unresolved > 0  # the lagging replica did disagree: with the tolerance alone it was struck


def test_a_random_liar_on_a_verifiable_stage_is_banned_after_strikes_checks_and_named_in_the_report() -> None:
    router, client, records = swarm(4, drift=0.5, liars={"body1.0.3"}, dim=64)  # honest replicas ~0.65 apart
    named, strikes = [], []
    checker = SpotChecker(
        SpotCheckConfig(fraction=1.0, strikes=3),
        router,
        {STAGE: client},
        on_ban=named.append,
        on_strike=strikes.append,
        rng=random.Random(4),
    )
    while checker.report()[STAGE].forward.state == "calibrating":
        check(checker, client, records[len(client.calls) % 3])
    strikes_before = checker.stats.strikes  # the liar may have been caught answering as a check already
    checks_of_its_answers = 0
    while not named:
        check(checker, client, records[3])
        checks_of_its_answers += 1
    assert checks_of_its_answers == 3 - strikes_before and named[0].worker.uid == "body1.0.3"
    report = checker.report()[STAGE]
    assert report.bans == 1 and report.strikes == 3 and report.forward.state == "verifiable"
    assert [(strike.worker.uid, strike.strikes) for strike in strikes] == [("body1.0.3", n) for n in (1, 2, 3)]
    assert all(strike.distance > math.sqrt(2) - MARGIN > strike.tolerance for strike in strikes)
    assert strikes[0].describe(MARGIN, 3).startswith("strike 1 of 3 for body1.0.3 on body1 forward: its answer was ")
    # the metrics carry it: a trainer's progress record holds the report as it crosses the DHT
    record = TrainerProgress(peer_id="t", microbatches=1, spot_checks=checker.report(), ts=1.0)
    assert (
        TrainerProgress.model_validate(record.model_dump()).spot_checks[STAGE].forward.tolerance
        == report.forward.tolerance
    )
