"""SPARTA's round timing from the link: the rule, the clamping of what a groupmate announces, the link estimate."""

from __future__ import annotations

import pytest
import torch

from agora_client.averaging.link_timing import MAX_RATE, MIN_RATE, LinkMeter, LinkRates, butterfly_bytes, round_timing
from agora_client.config import SpartaConfig

MBIT = 1e6 / 8  # bytes/s
CONFIG = SpartaConfig(allreduce_timeout=30.0, sender_timeout=10.0, reducer_timeout=10.0)
PART = 512 * 1024


def test_butterfly_moves_2_n_minus_1_over_n_of_the_slice_per_peer():
    assert butterfly_bytes(100e6, 2) == pytest.approx(100e6)
    assert butterfly_bytes(100e6, 4) == pytest.approx(150e6)
    assert butterfly_bytes(100e6, 1) == 0.0


def test_timeouts_follow_the_bytes_and_the_slowest_rate_with_the_config_as_floor():
    head_slice = 274e6  # 5% of the 8b head in fp32: the figure
    at_100 = round_timing(head_slice, 2, 100 * MBIT, PART, CONFIG)
    assert at_100.expected_s == pytest.approx(head_slice / (100 * MBIT))  # ~22 s
    assert at_100.allreduce_timeout == pytest.approx(2 * at_100.expected_s + at_100.reducer_timeout)
    at_50 = round_timing(head_slice, 2, 50 * MBIT, PART, CONFIG)
    assert at_50.expected_s == pytest.approx(2 * at_100.expected_s) and at_50.allreduce_timeout > 30.0 * 2
    three = round_timing(head_slice, 3, 100 * MBIT, PART, CONFIG)
    assert three.expected_s == pytest.approx(4 / 3 * at_100.expected_s)
    tiny = round_timing(300e3, 2, 100 * MBIT, PART, CONFIG)  # a fast round keeps the configured bounds
    assert (tiny.allreduce_timeout, tiny.sender_timeout, tiny.reducer_timeout) == (30.0, 10.0, 20.0)
    slow_parts = round_timing(300e3, 3, MIN_RATE, PART, CONFIG)  # 2 parts in flight at 2 Mbit/s: 4.2 s, doubled
    assert slow_parts.sender_timeout == 10.0 and round_timing(300e3, 9, MIN_RATE, PART, CONFIG).sender_timeout > 10.0


def test_a_rate_is_clamped_so_no_peer_can_make_its_group_wait_for_ever():
    assert round_timing(274e6, 2, 1.0, PART, CONFIG) == round_timing(274e6, 2, MIN_RATE, PART, CONFIG)
    assert LinkRates.announced({"up": 1.0, "down": 1e30}) == LinkRates(MIN_RATE, MAX_RATE)
    for junk in (
        None,
        "fast",
        {"up": float("nan"), "down": 1e6},
        {"up": -5, "down": 1e6},
        {"up": 1e6},
        {"up": True, "down": []},
    ):
        assert LinkRates.announced(junk) is None


def test_the_link_estimate_is_the_best_recent_round_and_starts_from_the_assumed_rate_and_a_probe_sets_the_uplink():
    meter = LinkMeter(LinkRates(50 * MBIT, 50 * MBIT))
    assert meter.rates == LinkRates(50 * MBIT, 50 * MBIT)
    meter.record(10_000_000, 20_000_000, 2.0)  # 5 MB/s up, 10 MB/s down
    meter.record(4_000_000, 4_000_000, 2.0)  # a round paced by a slower groupmate
    assert meter.rates == LinkRates(5e6, 10e6)
    meter.record(0, 0, 2.0)  # nothing moved: not a measurement
    meter.record(900_000_000, 900_000_000, 0.5)  # too short to tell the link from the latency
    for _ in range(5):
        meter.record(2_000_000, 2_000_000, 1.0)  # the link got slower: five rounds later the estimate follows
    assert meter.rates == LinkRates(2e6, 2e6)
    meter.record_probe(9e6)  # this worker's own uplink, which its rounds cannot show: it replaces theirs
    meter.record(2_000_000, 2_000_000, 1.0)
    assert meter.rates == LinkRates(9e6, 2e6)


@pytest.mark.parametrize("payload, bytes_per_value", [("fp32", 4), ("bf16", 3), ("int8", 1)])
def test_a_group_is_timed_by_the_slowest_link_its_members_announce(payload: str, bytes_per_value: float):
    from hivemind import DHT

    from agora_client.averaging.compression import SlicePayload
    from agora_client.averaging.sparta import _GroupAverager

    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        buffer = torch.zeros(25_000_000)  # a 100 MB slice in fp32; bf16 sends 2 bytes and gets 4 back, int8 1 and 1
        wire = SlicePayload(payload, buffer)
        averager = _GroupAverager(
            buffer, dht, layout=b"x", config=CONFIG, admission=None, prefix="timing", payload=wire
        )
        fast, slow = {"up": 200 * MBIT, "down": 200 * MBIT}, {"up": 20 * MBIT, "down": 200 * MBIT}
        timeouts = averager.group_timeouts(
            [{"weight": 1.0, "link": fast}, {"weight": 1.0, "link": slow}, {"weight": 1.0}]
        )
        moved = 25e6 * bytes_per_value
        expected = round_timing(moved, 3, 20 * MBIT, wire.largest_message_bytes, CONFIG)
        assert (timeouts.allreduce_s, timeouts.sender_s, timeouts.reducer_s) == (
            expected.allreduce_timeout,
            expected.sender_timeout,
            expected.reducer_timeout,
        )
        liar = averager.group_timeouts([{"link": fast}, {"link": {"up": 1, "down": 1}}])  # clamped to MIN_RATE
        assert (
            liar.allreduce_s == round_timing(moved, 2, MIN_RATE, wire.largest_message_bytes, CONFIG).allreduce_timeout
        )
        if payload == "fp32":
            assert wire.largest_message_bytes == PART
    finally:
        dht.shutdown()
