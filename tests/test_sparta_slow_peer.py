"""A SPARTA round among three peers on hosts of their own (network namespaces), one with a 5x slower uplink
(tc tbf): the round completes with the whole group, and the slow peer reduces a smaller share of the slice.

Each peer is a process of its own (tests/sparta_peer.py) averaging one flat parameter of a few MB. The share
a peer reduces shows in the bytes it receives: as reducer of a share s of a slice of P bytes in a group of
three, it receives s x P from each of the two others, and back from the others the averages of the 1 - s of
its slice they reduced, (1 + s) x P in all. Equal shares give every peer the same figure.
"""

from __future__ import annotations

import os

import pytest

from tests.netns import BridgedHosts, unavailable
from tests.sparta_peer import close_averagers, open_averagers, run_round, start_peers, stop_peers

_SKIP = unavailable(shaping=True)
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

FAST_MBIT, SLOW_MBIT = 40.0, 8.0
SLOW = 2  # not peer 0, the DHT bootstrap: the slow link alone sets it apart
VALUES = 1_000_000  # 4 MB of float32: ~5 s over the slow uplink
# the first round runs on the assumed link; the rounds after it on the links measured by the ones before
ROUNDS = 3
ROUND_TIMEOUT = 120.0
LESS_SHARE = 0.9  # the slow peer's bytes received, at most this x the fast peers' (equal shares: ~1.0)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[list[dict]]:
    """Every peer's report of every round (round, then peer index)."""
    log_dir = tmp_path_factory.mktemp("sparta-slow-peer")
    with BridgedHosts(f"agi26t-{os.getpid()}", 3) as hosts:
        for index, host in enumerate(hosts.hosts):
            host.shape_uplink(SLOW_MBIT if index == SLOW else FAST_MBIT)
        peers = start_peers(hosts.hosts, log_dir)
        try:
            open_averagers(peers, "slowpeer", VALUES, {"fraction": 1.0}, ROUND_TIMEOUT)
            rounds = [run_round(peers, round_no, ROUND_TIMEOUT) for round_no in range(ROUNDS)]
            close_averagers(peers, ROUND_TIMEOUT)
        finally:
            stop_peers(peers)
    return rounds


def test_every_round_completes_with_the_whole_group_despite_the_slow_uplink(reports):
    for round_reports in reports:
        for index, report in enumerate(round_reports):
            assert report["ok"], f"peer {index}, round {report['round']}: {report['reason']}"
            assert report["group_size"] == 3, report
            assert report["fraction"] == 1.0, report


@pytest.mark.xfail(strict=True, reason=(
    "issue 26 part 3 not done: every peer announces bytes / all-reduce seconds of its last rounds as its bandwidth, "
    "and the slow peer paces everyone's all-reduce, so all three announce ~the slow uplink and reduce equal shares; "
    "remove this mark when a peer's own uplink is what it announces (strict: an unexpected pass fails)"
))
def test_the_slow_peer_reduces_a_smaller_share(reports):
    last = reports[-1]
    slow = last[SLOW]["bytes_received"]
    fast = [report["bytes_received"] for index, report in enumerate(last) if index != SLOW]
    assert slow < LESS_SHARE * min(fast), f"bytes received in round {ROUNDS - 1}: slow {slow:,}, fast {fast}"
