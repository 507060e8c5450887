"""The upload cap's token bucket (agora_client/upload_cap.py): what it lets through over time, shared
across forked processes, and the flag's values."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest

from agora_client.averaging.link_timing import MIN_RATE
from agora_client.upload_cap import BURST_S, MBIT, MIN_CAP_MBIT, WIRE_OVERHEAD, UploadCap, parse_cap_mbit


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_sender_waits_for_what_the_bucket_has_not_earned_yet():
    clock = FakeClock()
    cap = UploadCap(8.0, clock=clock)  # 1 MB/s, half a second's worth in the bucket
    assert cap.bytes_per_s == 8 * MBIT and cap.burst_bytes == pytest.approx(BURST_S * 1e6)
    assert cap.reserve(int(400_000 / WIRE_OVERHEAD)) == 0.0  # within the burst: at once
    wait = cap.reserve(int(1_000_000 / WIRE_OVERHEAD))  # 100 KB left: the next 900 KB take 0.9 s
    assert wait == pytest.approx(0.9, rel=1e-3)
    clock.now += 0.5  # half of that debt paid: the next sender queues behind the rest of it
    assert cap.reserve(0) == pytest.approx(0.4, rel=1e-3)
    clock.now += 60  # idle for a minute: the bucket is full again, never fuller
    assert cap.reserve(int(cap.burst_bytes / WIRE_OVERHEAD)) == pytest.approx(0.0, abs=1e-6)
    assert cap.reserve(int(MBIT / WIRE_OVERHEAD)) == pytest.approx(1 / 8, rel=1e-3)


def test_senders_that_always_wait_move_the_cap_over_any_window():
    clock = FakeClock()
    cap = UploadCap(20.0, clock=clock)
    sent: list[tuple[float, int]] = []  # (when it was handed over, bytes)
    for size in [300_000, 5_000, 1_200_000, 64_000] * 60:  # messages large and small, back to back
        clock.now += cap.reserve(size)  # sends once it may
        sent.append((clock.now, size))
    began, end = 1000.0, sent[-1][0]
    assert end - began > 20
    for start in range(int(began), int(end - 10)):
        window = sum(size for when, size in sent if start <= when < start + 10)
        assert window * WIRE_OVERHEAD <= cap.bytes_per_s * (10 + BURST_S) + 1  # the burst, then the rate
    total = sum(size for _, size in sent)
    assert total * WIRE_OVERHEAD / (end - began) == pytest.approx(cap.bytes_per_s, rel=0.05)  # it does use the cap


def _spend_in_child(cap: UploadCap, nbytes: int) -> None:
    cap.reserve(nbytes)


def test_forked_processes_spend_one_budget():
    clock = time.monotonic
    cap = UploadCap(MIN_CAP_MBIT, clock=clock)
    child = mp.get_context("fork").Process(target=_spend_in_child, args=(cap, int(cap.bytes_per_s * 5)))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert cap.reserve(0) > 3.0  # the child's 5 s worth is this process's debt too
    assert cap.paced_bytes == int(cap.bytes_per_s * 5)


def test_pace_waits_in_the_event_loop():
    cap = UploadCap(MIN_CAP_MBIT)
    started = time.monotonic()
    asyncio.run(cap.pace(int((cap.burst_bytes + 0.2 * cap.bytes_per_s) / WIRE_OVERHEAD)))
    assert time.monotonic() - started >= 0.15


def test_the_flag_takes_0_or_at_least_what_averaging_needs():
    assert MIN_CAP_MBIT * MBIT == MIN_RATE  # a capped worker never announces less than a group may be timed by
    assert parse_cap_mbit("0") == 0.0 and parse_cap_mbit("12.5") == 12.5
    for bad, said in (("fast", "not a number"), ("-3", "not a rate"), ("inf", "not a rate"), ("1", "below")):
        with pytest.raises(ValueError, match=said):
            parse_cap_mbit(bad)
    with pytest.raises(ValueError, match="no cap"):
        UploadCap(0)


def test_an_announced_rate_is_the_lower_of_the_link_and_the_cap():
    cap = UploadCap(10.0)
    assert cap.limit(100 * MBIT) == 10 * MBIT and cap.limit(4 * MBIT) == 4 * MBIT
