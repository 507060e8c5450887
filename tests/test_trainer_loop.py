"""The trainer's loop rates tokens per second only over windows of at least RATE_WINDOW_S: a report that follows
another at once (every microbatch in flight finished together) must not divide by almost nothing. The figure goes
to the [PROGRESS] line and to the DHT record the app, the monitor and the public page chart."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from agora_client.trainer.loop import RATE_WINDOW_S, TrainingLoop

ROWS, SEQ = 2, 8  # tokens per microbatch: ROWS * SEQ (the last column of a window is only a target)


class _Pipeline:
    def __init__(self, seconds_each: float):
        self.stop, self.spot_checks, self.seconds_each = threading.Event(), None, seconds_each

    def train_microbatch(self, batch: torch.Tensor) -> float:
        time.sleep(self.seconds_each)
        return 3.0


def _run(microbatches: int, seconds_each: float, inflight: int) -> list[float]:
    """Every tokens_per_s the loop published, reporting after every finished microbatch."""
    published: list[float] = []
    loop = TrainingLoop(
        _Pipeline(seconds_each), iter(lambda: torch.zeros(ROWS, SEQ + 1, dtype=torch.long), None),
        router=SimpleNamespace(window_stats=dict), traffic=SimpleNamespace(per_token=dict),
        progress=SimpleNamespace(publish=lambda done, loss, rate, **_: published.append(rate)),
        evaluation=SimpleNamespace(start_if_due=lambda: None, take_finished=list, latest=None),
        records=None, say=lambda tag, text: None, replica_drifts=dict,
    )
    assert loop.run(inflight, microbatches, report_every=0.0) == microbatches
    return published


def test_reports_right_after_each_other_never_rate_over_a_window_shorter_than_the_minimum():
    rates = _run(microbatches=9, seconds_each=0.01, inflight=3)
    assert rates and max(rates) <= 9 * ROWS * SEQ / RATE_WINDOW_S, rates


def test_a_run_longer_than_the_window_gets_a_rate_no_higher_than_its_tokens_allow():
    microbatches = int(2 * RATE_WINDOW_S / 0.05)
    rates = _run(microbatches=microbatches, seconds_each=0.05, inflight=1)
    assert 0 < max(rates) <= microbatches * ROWS * SEQ / RATE_WINDOW_S, rates
