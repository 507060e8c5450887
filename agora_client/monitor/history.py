"""Each contributor's points over time, for the public page: one point per identity per bucket of time, kept for a
bounded span (at most ``HISTORY_SPAN_S / HISTORY_BUCKET_S`` points per identity, the newest per bucket)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from agora_client.monitor.points import PeerState

HISTORY_BUCKET_S = 600.0
HISTORY_SPAN_S = 14 * 24 * 3600.0


@dataclass(frozen=True)
class HistoryPoint:
    ts: float
    presence: float  # points
    compute: float  # verified compute points


def bucket_of(ts: float) -> int:
    return int(ts // HISTORY_BUCKET_S)


def oldest_bucket_kept(now: float) -> int:
    return bucket_of(now - HISTORY_SPAN_S)


def identity_totals(peers: Iterable[PeerState], now: float) -> dict[str, HistoryPoint]:
    """Each identity's presence and verified compute points, summed over its peers, as of ``now``."""
    presence: dict[str, float] = defaultdict(float)
    compute: dict[str, float] = defaultdict(float)
    for peer in peers:
        presence[peer.identity] += peer.presence_points
        compute[peer.identity] += peer.compute_points
    return {identity: HistoryPoint(now, presence[identity], compute[identity]) for identity in presence}
