"""The monitor's series for operators: points accrued, contributors, the leaderboard's top, the trainers' escrow
(held, forfeited, disputed windows) and the latest scrape's view of the swarm (workers per stage, SPARTA rounds,
tokens). Read from the points store at every scrape."""

from __future__ import annotations

import time
from collections.abc import Callable

from agora_client.operator_metrics import Series, SeriesCollector, Values

from .points import PFLOP, leaderboard
from .store import PointsStore
from .swarm_summary import SwarmSummary

TOP_CONTRIBUTORS = 20  # the leaderboard's top rows get a series each: a bounded number of label values

POINTS = Series(
    "agora_monitor_points",
    "gauge",
    "points credited to all peers: presence, compute (verified by receipts) and claimed_compute (before the receipts)",
    ("kind",),
)
CONTRIBUTORS = Series("agora_monitor_contributors", "gauge", "contributors (identities) on the leaderboard")
CONTRIBUTORS_ONLINE = Series("agora_monitor_contributors_online", "gauge", "contributors with a peer seen lately")
CONTRIBUTOR_POINTS = Series(
    "agora_monitor_contributor_points",
    "gauge",
    f"score of each of the leaderboard's top {TOP_CONTRIBUTORS} contributors",
    ("contributor",),
)
FLAGGED = Series("agora_monitor_flagged_contributors", "gauge", "contributors claiming more compute than receipted")
WITHHELD = Series(
    "agora_monitor_withheld_peers", "gauge", "peers whose compute points are withheld (caught by spot checks)"
)
ESCROW = Series(
    "agora_monitor_escrow_pflops",
    "gauge",
    "compute of stages spot checks could not judge, per the trainers' latest receipts: held (waiting to be vouched "
    "for) and forfeited (caught, disputed or expired unpaid)",
    ("state",),
)
DISPUTED = Series(
    "agora_monitor_disputed_windows",
    "gauge",
    "escrow windows whose spot checks disagreed with nobody to blame: paid to neither side (one per worker)",
)
STAGE_WORKERS = Series(
    "agora_monitor_stage_workers",
    "gauge",
    "the stage's workers at the latest scrape: active, syncing, or queued at the auth service",
    ("stage", "state"),
)
STAGE_SPARTA_ROUNDS = Series(
    "agora_monitor_stage_sparta_rounds", "gauge", "SPARTA rounds the stage's live workers took part in", ("stage",)
)
TOKENS_PER_SECOND = Series("agora_monitor_tokens_per_second", "gauge", "all live trainers' tokens per second")
TOKENS_SEEN = Series("agora_monitor_tokens_seen", "gauge", "tokens the first stage processed since the monitor started")
SERIES = (
    POINTS,
    CONTRIBUTORS,
    CONTRIBUTORS_ONLINE,
    CONTRIBUTOR_POINTS,
    FLAGGED,
    WITHHELD,
    ESCROW,
    DISPUTED,
    STAGE_WORKERS,
    STAGE_SPARTA_ROUNDS,
    TOKENS_PER_SECOND,
    TOKENS_SEEN,
)


def monitor_collector(store: PointsStore, clock: Callable[[], float] = time.time) -> SeriesCollector:
    def read() -> dict[str, Values]:
        peers = list(store.peers().values())
        rows = leaderboard(peers, clock(), store.policy)
        escrow = store.escrow()
        values: dict[str, Values] = {
            POINTS.name: {
                "presence": sum(peer.presence_points for peer in peers),
                "compute": sum(peer.compute_points for peer in peers),
                "claimed_compute": sum(peer.claimed_points for peer in peers),
            },
            CONTRIBUTORS.name: len(rows),
            CONTRIBUTORS_ONLINE.name: sum(row.online for row in rows),
            CONTRIBUTOR_POINTS.name: {row.username: row.score for row in rows[:TOP_CONTRIBUTORS]},
            FLAGGED.name: sum(row.flagged for row in rows),
            WITHHELD.name: sum(peer.withheld for peer in peers),
            ESCROW.name: {"held": escrow.held_flops / PFLOP, "forfeited": escrow.forfeited_flops / PFLOP},
            DISPUTED.name: escrow.disputed_windows,
        }
        summary = store.summary()
        return values if summary is None else {**values, **_swarm_values(summary)}

    return SeriesCollector(SERIES, read)


def _swarm_values(summary: SwarmSummary) -> dict[str, Values]:
    """The latest scrape's figures (absent before the monitor's first scrape).

    Queued only when it knows the auth service."""
    workers: dict[tuple[str, str], float] = {}
    for stage in summary.stages:
        workers[stage.stage, "active"], workers[stage.stage, "syncing"] = stage.active, stage.syncing
        if stage.queued is not None:
            workers[stage.stage, "queued"] = stage.queued
    return {
        STAGE_WORKERS.name: workers,
        STAGE_SPARTA_ROUNDS.name: {stage.stage: stage.sparta_rounds for stage in summary.stages},
        TOKENS_PER_SECOND.name: summary.tokens_per_s,
        TOKENS_SEEN.name: summary.tokens_seen,
    }
