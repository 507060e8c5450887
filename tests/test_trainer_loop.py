"""The trainer's loop rates tokens per second only over windows of at least RATE_WINDOW_S: a report that follows
another at once (every microbatch in flight finished together) must not divide by almost nothing. The figure goes
to the [PROGRESS] line and to the DHT record the app, the monitor and the public page chart. It keeps the run
config's optim.inflight microbatches in flight (the trainer's --inflight overrides it)."""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from agora_client.config import ConfigError, load_config
from agora_client.trainer.loop import RATE_WINDOW_S, TrainingLoop
from agora_client.trainer.main import _overrides, configure

ROWS, SEQ = 2, 8  # tokens per microbatch: ROWS * SEQ (the last column of a window is only a target)


class _Pipeline:
    def __init__(self, seconds_each: float):
        self.stop, self.spot_checks, self.seconds_each = threading.Event(), None, seconds_each
        self.lock, self.running, self.most_running = threading.Lock(), 0, 0

    def train_microbatch(self, batch: torch.Tensor) -> float:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.seconds_each)
        with self.lock:
            self.running -= 1
        return 3.0


def _run(microbatches: int, seconds_each: float, inflight: int, pipeline: _Pipeline | None = None) -> list[float]:
    """Every tokens_per_s the loop published, reporting after every finished microbatch."""
    published: list[float] = []
    loop = TrainingLoop(
        pipeline or _Pipeline(seconds_each),
        iter(lambda: torch.zeros(ROWS, SEQ + 1, dtype=torch.long), None),
        router=SimpleNamespace(window_stats=dict),
        traffic=SimpleNamespace(per_token=dict),
        progress=SimpleNamespace(publish=lambda done, loss, rate, **_: published.append(rate)),
        evaluation=SimpleNamespace(start_if_due=lambda: None, take_finished=list, latest=None),
        records=None,
        say=lambda tag, text: None,
        replica_drifts=dict,
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


def test_the_loop_keeps_exactly_inflight_microbatches_going():
    for inflight in (1, 2, 3):
        pipeline = _Pipeline(seconds_each=0.3)  # long enough that every thread of the pool starts before one ends
        _run(microbatches=2 * inflight, seconds_each=0.3, inflight=inflight, pipeline=pipeline)
        assert pipeline.most_running == inflight


def test_the_microbatches_in_flight_come_from_the_run_config_unless_the_command_line_says():
    parser = argparse.ArgumentParser()
    configure(parser)
    plain = parser.parse_args(["--seeds", "/ip4/127.0.0.1/tcp/1"])
    assert load_config("tiny", _overrides(plain)).optim.inflight == 2
    assert load_config("8b", _overrides(plain)).optim.inflight == 3
    given = parser.parse_args(["--seeds", "/ip4/127.0.0.1/tcp/1", "--inflight", "5"])
    assert load_config("tiny", _overrides(given)).optim.inflight == 5
    with pytest.raises(ConfigError, match="inflight"):
        load_config("tiny", _overrides(parser.parse_args(["--seeds", "/ip4/127.0.0.1/tcp/1", "--inflight", "0"])))
