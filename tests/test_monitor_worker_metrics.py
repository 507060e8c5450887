"""WorkerMetrics counters and the client's local points estimate."""

from __future__ import annotations

import threading

import pytest

from agora_client.config import load_config
from agora_client.monitor.estimate import ConfirmedPoints, estimate_points
from agora_client.monitor.flops import request_flops
from agora_client.monitor.points import PFLOP
from agora_client.worker.metrics import WorkerMetrics

MODEL = load_config("tiny").model


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: FakeClock) -> WorkerMetrics:
    return WorkerMetrics(
        MODEL, "tail", peer_id="peer", identity="alice", ticket="ticket", clock=clock, wall_clock=clock
    )


def test_active_time_runs_from_phase_1_and_stops_when_the_worker_leaves():
    clock = FakeClock()
    metrics = make(clock)
    with pytest.raises(ValueError, match="not registered"):
        metrics.snapshot()
    clock.now += 50  # authorizing, downloading: not registered yet
    metrics.set_phase("sync1")
    clock.now += 100
    metrics.set_phase("sync2")
    clock.now += 20
    assert metrics.snapshot().active_seconds == pytest.approx(120)
    metrics.set_phase(None)
    clock.now += 500
    assert metrics.active_seconds() == pytest.approx(120)
    metrics.set_phase("sync1")  # fell behind, back to phase 1: presence continues
    clock.now += 10
    assert metrics.snapshot().active_seconds == pytest.approx(130)


def test_only_flops_from_phase_2_on_are_compute():
    metrics = make(FakeClock())
    metrics.set_phase("sync1")
    first = metrics.on_backward((8, 128))
    metrics.set_phase("sync2")
    second = metrics.on_backward((8, 128))
    metrics.set_phase("active")
    third = metrics.on_forward((8, 128))
    record = metrics.snapshot()
    assert first == second == request_flops(MODEL, "tail", "backward", 8, 128)
    assert third == request_flops(MODEL, "tail", "forward", 8, 128)
    assert record.flops_total == first + second + third
    assert record.compute_flops == second + third
    assert (record.batches, record.forwards, record.tokens) == (2, 1, 2 * 8 * 128)


def test_counters_are_exact_under_concurrent_updates():
    metrics = make(FakeClock())
    metrics.set_phase("active")
    per_request = request_flops(MODEL, "tail", "backward", 2, 16)
    threads = [
        threading.Thread(target=lambda: [metrics.on_backward((2, 16), busy_seconds=0.001) for _ in range(200)])
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    record = metrics.snapshot()
    assert record.batches == 800
    assert record.compute_flops == 800 * per_request
    assert record.busy_seconds == pytest.approx(0.8)


def test_sparta_statistics_and_bad_tokens():
    metrics = make(FakeClock())
    metrics.set_phase("active")
    metrics.on_sparta_round(True, 1.0)
    metrics.on_sparta_round(False, 0.0)
    metrics.on_sparta_round(True, 0.66)
    record = metrics.snapshot()
    assert (record.sparta_rounds, record.sparta_last_fraction) == (3, 0.66)
    assert record.sparta_success_rate == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        metrics.on_forward((8,))


def test_estimate_matches_what_the_monitor_would_credit():
    clock = FakeClock()
    metrics = make(clock)
    metrics.set_phase("sync2")
    previous = metrics.snapshot()
    clock.now += 1800
    flops = sum(metrics.on_backward((8, 128)) for _ in range(10))
    current = metrics.snapshot()
    monitor = ConfirmedPoints(score=0.25, verified_compute=0.2, claimed_compute=0.3, flagged=False)
    event = estimate_points(current, previous, confirmed=monitor)
    assert event.presence == pytest.approx(0.5)
    assert event.compute == pytest.approx(flops / PFLOP)
    assert event.rate_per_hour == pytest.approx(1.0 + 2 * flops / PFLOP)
    assert (event.confirmed, event.verified_compute, event.claimed_compute, event.flagged) == (0.25, 0.2, 0.3, False)
    assert estimate_points(current).rate_per_hour == 1.0
