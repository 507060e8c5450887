"""A worker under an upload cap (--max-upload-mbit) on a real link: two SPARTA peers on hosts of their own (network
namespaces, tests/sparta_peer.py), both on 40 Mbit/s uplinks (tc tbf), one capped at 8 Mbit/s. What the capped
host's interface sends (its tx_bytes, which count every header) stays under 1.1 x the cap over any 10 s, while its
rounds keep it busy; and the rounds succeed although the run config's time bounds are far too short for them:
the capped peer announces its cap as its uplink, and its group times itself by that.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from agora_client.averaging.link_timing import round_timing
from agora_client.config import SpartaConfig
from agora_client.engine.averaging import DEFAULT_PART_SIZE_BYTES
from agora_client.upload_cap import MBIT
from tests.netns import BridgedHosts, Host, unavailable
from tests.sparta_peer import close_averagers, open_averagers, run_round, start_peers, stop_peers

_SKIP = unavailable(shaping=True)
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

LINK_MBIT, CAP_MBIT = 40.0, 8.0
CAPPED = 1
VALUES = 3_000_000  # 12 MB of float32: a peer of two sends about that much a round, ~12.5 s at the cap
ROUNDS = 1
WINDOW_S = 10.0
# floors far below what a round takes at the cap (~8 s): only bounds derived from the cap let the rounds finish
SPARTA = {"fraction": 1.0, "matchmaking_time": 3.0, "allreduce_timeout": 5.0, "sender_timeout": 2.0,
          "reducer_timeout": 2.0}  # fmt: skip
ROUND_TIMEOUT = 120.0


class TxSampler(threading.Thread):
    """Samples a host's interface counter of bytes sent (inside its namespace) every ``period`` seconds."""

    def __init__(self, host: Host, period: float = 0.25):
        super().__init__(name="tx-sampler", daemon=True)
        self.host, self.period = host, period
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def read(self) -> int:
        return int(self.host.run("cat", f"/sys/class/net/{self.host.device}/statistics/tx_bytes").stdout)

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.samples.append((time.monotonic(), self.read()))

    def busiest(self, window_s: float) -> float:
        """The most bytes per second the interface sent over any ``window_s`` seconds of the samples."""
        best = 0.0
        for start, sent_before in self.samples:
            later = [(when, sent) for when, sent in self.samples if when - start >= window_s]
            if later:
                when, sent = later[0]
                best = max(best, (sent - sent_before) / (when - start))
        return best


@pytest.fixture(scope="module")
def capped_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("upload-cap")
    with BridgedHosts(f"agi47u-{os.getpid()}", 2) as hosts:
        for host in hosts.hosts:
            host.shape_uplink(LINK_MBIT)
        peers = start_peers(hosts.hosts, log_dir, caps={CAPPED: CAP_MBIT})
        sampler = TxSampler(hosts[CAPPED])
        try:
            open_averagers(peers, "uploadcap", VALUES, SPARTA, ROUND_TIMEOUT)
            sampler.start()
            rounds = [run_round(peers, round_no, ROUND_TIMEOUT, with_links=True) for round_no in range(ROUNDS)]
            sampler.stop.set()
            sampler.join(timeout=10)
            close_averagers(peers, ROUND_TIMEOUT)
        finally:
            sampler.stop.set()
            stop_peers(peers)
    return rounds, sampler


def test_the_capped_interface_sends_at_most_1_1_x_the_cap_over_any_10_s(capped_run):
    _, sampler = capped_run
    assert sampler.samples[-1][0] - sampler.samples[0][0] > WINDOW_S, "the rounds ended before a window"
    busiest = sampler.busiest(WINDOW_S)
    assert busiest <= 1.1 * CAP_MBIT * MBIT, f"{busiest * 8 / 1e6:.2f} Mbit/s over {WINDOW_S:.0f} s"
    assert busiest >= 0.6 * CAP_MBIT * MBIT, f"only {busiest * 8 / 1e6:.2f} Mbit/s: the rounds did not use the cap"


def test_the_capped_peers_rounds_succeed_timed_by_the_cap_it_announces(capped_run):
    rounds, _ = capped_run
    config = SpartaConfig(**SPARTA)
    for round_reports in rounds:
        for index, (report, _) in enumerate(round_reports):
            assert report["ok"] and report["fraction"] == 1.0, f"peer {index}: {report['reason']}"
            assert report["group_size"] == 2
        report, link = round_reports[CAPPED]
        assert 0.8 * CAP_MBIT * MBIT <= link["up"] <= CAP_MBIT * MBIT  # min(measured uplink, cap): its paced probe
        at_cap = round_timing(report["bytes_sent"], 2, CAP_MBIT * MBIT, DEFAULT_PART_SIZE_BYTES, config)
        at_link = round_timing(report["bytes_sent"], 2, LINK_MBIT * MBIT, DEFAULT_PART_SIZE_BYTES, config)
        # the round took the time the cap allows (paced), which bounds from the link alone would have cut short
        assert report["allreduce_s"] >= 0.8 * at_cap.expected_s, (report["allreduce_s"], at_cap.expected_s)
        assert at_link.allreduce_timeout < report["allreduce_s"] < at_cap.allreduce_timeout
