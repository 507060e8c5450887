"""A SPARTA round among three peers on hosts of their own (network namespaces), one with a 5x slower uplink
(tc tbf): the round completes with the whole group; after the rounds each peer probes its own uplink in turn
(averaging/uplink.py), and from then on the slow peer reduces a smaller share of the slice.

Each peer is a process of its own (tests/sparta_peer.py) averaging one flat parameter of a few MB. The share
a peer reduces shows in the bytes it receives: as reducer of a share s of a slice of P bytes in a group of
three, it receives s x P from each of the two others, and back from the others the averages of the 1 - s of
its slice they reduced, (1 + s) x P in all. Equal shares give every peer the same figure.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.netns import BridgedHosts, unavailable
from tests.sparta_peer import close_averagers, open_averagers, run_round, start_peers, stop_peers

_SKIP = unavailable(shaping=True)
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

FAST_MBIT, SLOW_MBIT = 40.0, 8.0
SLOW = 2  # not peer 0, the DHT bootstrap: the slow link alone sets it apart
VALUES = 1_000_000  # 4 MB of float32: ~5 s over the slow uplink
# the first round runs on the assumed link; after each round one member probes its uplink (a turn that moves
# with the round number), so the last round runs on every peer's own uplink. A turn whose round kept a part local
# (MIN_FRACTION below) passes without a probe, and that member's next turn comes three rounds later.
PROBING_ROUNDS, MAX_PROBING_ROUNDS = 3, 9
ROUND_TIMEOUT = 120.0
LESS_SHARE = 0.9  # the slow peer's bytes received, at most this x the fast peers' (equal shares: ~1.0)
# A slow peer given up drops its whole share (a third) for everyone. What this test allows is a reducer's stream
# broken before its last part, 1/64 of the slice kept local (seen once in CI, in a ~5 s round whose bounds are 10 s
# a part: not a wait on the slow link).
MIN_FRACTION = 0.95


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
            rounds = [run_round(peers, round_no, ROUND_TIMEOUT) for round_no in range(PROBING_ROUNDS)]
            while not all(_probes(rounds, index) for index in range(len(peers))) and len(rounds) < MAX_PROBING_ROUNDS:
                rounds.append(run_round(peers, len(rounds), ROUND_TIMEOUT))
            rounds.append(run_round(peers, len(rounds), ROUND_TIMEOUT))  # on every peer's own uplink
            close_averagers(peers, ROUND_TIMEOUT)
        finally:
            stop_peers(peers)
    return rounds


def _probes(rounds: list[list[dict]], index: int) -> list[str]:
    """What peer ``index`` said of its uplink probes in these rounds."""
    return [round_reports[index]["uplink"] for round_reports in rounds if round_reports[index]["uplink"]]


def test_every_round_completes_with_the_whole_group_despite_the_slow_uplink(reports):
    for round_reports in reports:
        for index, report in enumerate(round_reports):
            assert report["ok"], f"peer {index}, round {report['round']}: {report['reason']}"
            assert report["group_size"] == 3, report
            assert report["fraction"] >= MIN_FRACTION, (
                index,
                report["round"],
                report["reason"],
                report["bytes_sent"],
                report["allreduce_s"],
            )


def test_each_peer_probes_its_own_uplink_once_in_turn(reports):
    measured = []
    for index in range(len(reports[0])):
        said = _probes(reports[:-1], index)
        match = re.match(r"measured this worker's uplink at ([0-9.]+) Mbit/s", said[0] if len(said) == 1 else "")
        assert match, f"peer {index}: {said}"
        measured.append(float(match.group(1)))
    slow, fast = measured[SLOW], [rate for index, rate in enumerate(measured) if index != SLOW]
    assert slow <= 1.5 * SLOW_MBIT and min(fast) > 2 * slow, measured  # the shaped links, not the group's pace


def test_the_slow_peer_reduces_a_smaller_share(reports):
    last = reports[-1]
    slow = last[SLOW]["bytes_received"]
    fast = [report["bytes_received"] for index, report in enumerate(last) if index != SLOW]
    assert slow < LESS_SHARE * min(fast), f"bytes received in round {len(reports) - 1}: slow {slow:,}, fast {fast}"
