"""SPARTA's round timing from the link, not from constants.

A butterfly all-reduce among n peers moves, per peer, 2(n-1)/n of the slice each way: (n-1)/n of it to the
other reducers and back as their averages, and as much again for the part it reduces itself. A round takes
about that many bytes over the slowest link in the group. The time bounds of a round follow from it, with a
margin; the run config's figures are floors (what a round on a fast link may take for matchmaking and
scheduling). Each worker measures its own link on every round (``LinkMeter``) and announces it to its group,
so that the group times itself by its slowest member and hivemind's load balancing hands that member a
smaller share of the parts to reduce.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from agora_client.config import SpartaConfig

MARGIN = 2.0  # a round may take twice what the measured rates predict before it is given up
MIN_RATE = 2e6 / 8  # bytes/s (2 Mbit/s): the slowest link a peer may announce; bounds how long a group waits
MAX_RATE = 10e9 / 8  # bytes/s (10 Gbit/s)
SAMPLES = 5  # rounds a link estimate remembers
MIN_SAMPLE_S = 1.0  # a shorter all-reduce measures latency, not the link: it is not a sample


@dataclass(frozen=True)
class LinkRates:
    """A link's rates in bytes per second."""

    up: float
    down: float

    @property
    def slowest(self) -> float:
        return min(self.up, self.down)

    def to_json(self) -> dict[str, float]:
        return {"up": self.up, "down": self.down}

    @classmethod
    def announced(cls, data: object) -> "LinkRates | None":
        """The rates a groupmate announced, clamped to [MIN_RATE, MAX_RATE]; None if it announced nothing usable."""
        if not isinstance(data, dict):
            return None
        rates = [data.get("up"), data.get("down")]
        if not all(isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0 for rate in rates):
            return None
        up, down = (min(MAX_RATE, max(MIN_RATE, float(rate))) for rate in rates)
        return cls(up, down)


def butterfly_bytes(payload_bytes: float, group_size: int) -> float:
    """Bytes one peer sends (and receives) in a butterfly all-reduce of ``payload_bytes`` among ``group_size`` peers."""
    return 2 * (group_size - 1) / group_size * payload_bytes if group_size > 1 else 0.0


@dataclass(frozen=True)
class RoundTiming:
    expected_s: float  # what the round should take at the slowest rate
    allreduce_timeout: float
    sender_timeout: float  # a reducer waits this long for a sender's next part...
    reducer_timeout: float  # ...and a sender this long for a reducer's next averaged part

    def describe(self) -> str:
        return (
            f"expected {self.expected_s:.1f}s, bounded at {self.allreduce_timeout:.0f}s "
            f"(parts: {self.sender_timeout:.0f}s / {self.reducer_timeout:.0f}s)"
        )


def round_timing(
    payload_bytes: float, group_size: int, slowest_rate: float, part_size_bytes: int, config: SpartaConfig
) -> RoundTiming:
    """Time bounds of one round: ``payload_bytes`` averaged among ``group_size`` peers whose slowest link moves
    ``slowest_rate`` bytes/s; the config's timeouts are floors."""
    rate = min(MAX_RATE, max(MIN_RATE, slowest_rate))
    expected = butterfly_bytes(payload_bytes, group_size) / rate
    # a sender streams a part to each of the n-1 other reducers at once over its uplink (and a reducer its averages)
    next_part = (group_size - 1) * part_size_bytes / rate
    sender = max(config.sender_timeout, MARGIN * next_part)
    # a reducer returns a part only once every sender's copy of it has arrived: it waits for the slowest sender first
    reducer = sender + max(config.reducer_timeout, MARGIN * next_part)
    allreduce = max(config.allreduce_timeout, MARGIN * expected + reducer)
    return RoundTiming(expected, allreduce, sender, reducer)


class LinkMeter:
    """This worker's link, from its own rounds: bytes moved over the all-reduce's duration.

    A round's rate is a lower bound on the link (the group's slowest peer paces everyone), so the estimate is
    the best of the last few rounds; before any round long enough to tell, ``assumed`` from the run config.
    The uplink a probe measured (``record_probe``: this worker's alone, see averaging/uplink.py) replaces the
    rounds' figure for the uplink. With an upload cap (``max_up``, bytes/s) the uplink is never more than the cap."""

    def __init__(self, assumed: LinkRates, max_up: float | None = None):
        self._up: deque[float] = deque(maxlen=SAMPLES)
        self._down: deque[float] = deque(maxlen=SAMPLES)
        self._assumed = assumed
        self._probed_up: float | None = None
        self._max_up = MAX_RATE if max_up is None else max_up

    def record_probe(self, uplink: float) -> None:
        self._probed_up = uplink

    def record(self, bytes_sent: int, bytes_received: int, allreduce_s: float) -> None:
        if allreduce_s < MIN_SAMPLE_S or bytes_sent + bytes_received == 0:
            return
        self._up.append(bytes_sent / allreduce_s)
        self._down.append(bytes_received / allreduce_s)

    @property
    def rates(self) -> LinkRates:
        measured = self._assumed if not self._up else LinkRates(max(self._up), max(self._down))
        up = min(self._max_up, measured.up if self._probed_up is None else self._probed_up)
        return LinkRates(min(MAX_RATE, max(MIN_RATE, up)), min(MAX_RATE, max(MIN_RATE, measured.down)))
