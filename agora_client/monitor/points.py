"""Points from observed worker metrics: pure logic, no I/O.

Presence: 1 PFLOP for every hour a peer is registered and visible, from sync phase 1 on.
Compute: the PFLOPs a peer processed, from sync phase 2 on, as far as trainers' receipts vouch for them:
the lesser of what the peer claims (the rules below) and what ticketed trainers receipted it as payable
(``monitor/receipts.py``: work a stage's spot checks could not judge waits in the trainer's escrow,
trainer/escrow.py). A claim more than ``claim_margin`` over all it was receipted, held or not, is flagged.

Presence is what the swarm saw, never what a worker says: the monitor's own clock between two successive
fresh records of the peer (each signed by its key, carrying a live slot ticket, and newer than the last one
credited) while its stage's roster shows it (``swarm_phase``) and the auth service lists it holding a slot
(``holds_slot``; both set by monitor/scraper.py), at most ``online_window_s`` apart. The operator's own workers, whose
tickets it signs itself, hold no slot there: they earn compute, never presence. Run ids and counters a worker
publishes do not touch it, a replayed record is not fresh, and a crash and rejoin loses the gap.

Compute comes from the peer's monotonic counter (``compute_flops``: FLOPs processed from phase 2 on): the
monitor credits its increments between successive fresh records, so a disconnect (of the peer or of the monitor)
loses nothing already earned; a new run (new ``run_id``, or a lower counter) starts from zero. An increment
earns only while both the peer's claim and its stage's roster (what trainers route on) put it in phase 2 or
active: a worker the roster keeps in phase 1 is one trainers never routed to.

An identity earns with at most ``identity_cap`` concurrently online peers, ranked by first seen;
a peer over the cap keeps being observed (its counters advance) but earns nothing.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from agora_client.events import SyncPhase

PFLOP = 1e15
SECONDS_PER_HOUR = 3600.0
PRESENCE_PHASES: frozenset[str] = frozenset({"sync1", "sync2", "active"})
COMPUTE_PHASES: frozenset[str] = frozenset({"sync2", "active"})


@dataclass(frozen=True)
class PointsPolicy:
    identity_cap: int = 2
    # A peer not observed for this long is offline; two fresh records further apart than this credit no presence.
    online_window_s: float = 90.0
    # A claim this far over its receipts is flagged; receipts trail claims by a publishing period, hence the slack.
    claim_margin: float = 0.25
    claim_slack_flops: float = 1e13


@dataclass(frozen=True)
class Observation:
    """One verified metrics record, as the monitor saw it at ``seen_at`` (monitor clock)."""

    peer_id: str
    identity: str
    stage: str
    run_id: str
    sync_phase: SyncPhase  # what the peer claims
    active_seconds: float
    compute_flops: float
    seen_at: float
    published_at: float  # the record's own signed timestamp: a record not newer than the last one is not fresh
    swarm_phase: SyncPhase | None  # the phase its stage's roster shows (what trainers route on); None: not in it
    holds_slot: bool = True  # the auth service lists it holding a slot in its stage (True where the monitor cannot ask)


@dataclass(frozen=True)
class PeerState:
    """What the monitor remembers of one peer: its last counters and the totals it was credited."""

    peer_id: str
    identity: str
    stage: str
    first_seen: float
    last_seen: float
    sync_phase: str
    run_id: str
    last_active_seconds: float
    last_compute_flops: float
    last_published_at: float  # the own timestamp of its latest fresh record (seen at ``last_seen``)
    presence_seconds: float = 0.0  # credited
    compute_flops: float = 0.0  # claimed and accepted by the rules (phases, restarts, the identity cap)
    withheld: bool = False  # a trainer's spot checks caught it returning wrong outputs: no compute, no more presence
    receipted_flops: float = 0.0  # what ticketed trainers' receipts say it served them
    unpaid_flops: float = 0.0  # of that, what the trainers' escrow holds or forfeited (trainer/escrow.py)

    @property
    def presence_points(self) -> float:
        return self.presence_seconds / SECONDS_PER_HOUR

    @property
    def claimed_points(self) -> float:
        return self.compute_flops / PFLOP

    @property
    def compute_points(self) -> float:
        """Verified compute: the claim as far as receipts vouch for it, escrow released (none for a withheld peer)."""
        return 0.0 if self.withheld else min(self.compute_flops, self.receipted_flops - self.unpaid_flops) / PFLOP

    def over_claimed(self, policy: PointsPolicy) -> bool:
        return self.compute_flops > self.receipted_flops * (1 + policy.claim_margin) + policy.claim_slack_flops

    @property
    def score(self) -> float:
        return self.presence_points + self.compute_points

    def online(self, now: float, policy: PointsPolicy) -> bool:
        return now - self.last_seen <= policy.online_window_s


@dataclass(frozen=True)
class LeaderboardRow:
    rank: int
    username: str
    active_hours: float
    joined: str
    score: float
    online: bool
    flagged: bool = False  # one of its peers claims more compute than trainers receipted it


def _is_new_run(previous: PeerState, observation: Observation) -> bool:
    return previous.run_id != observation.run_id or observation.compute_flops < previous.last_compute_flops


def is_fresh(previous: PeerState | None, observation: Observation) -> bool:
    """A record newer than the last one credited: the peer signed it since (a replay or a stale copy is not)."""
    return previous is None or observation.published_at > previous.last_published_at


@dataclass(frozen=True)
class Increment:
    presence_seconds: float
    compute_flops: float


def increments(previous: PeerState | None, observation: Observation, policy: PointsPolicy) -> Increment:
    """What a fresh ``observation`` earns over ``previous``, before the identity cap."""
    presence = 0.0
    # A first sighting proves nothing about the time before it.
    live_for = observation.seen_at - previous.last_seen if previous is not None else 0.0
    if (
        0.0 < live_for <= policy.online_window_s
        and observation.holds_slot
        and observation.sync_phase in PRESENCE_PHASES
        and observation.swarm_phase in PRESENCE_PHASES
    ):
        presence = live_for
    base_flops = 0.0 if previous is None or _is_new_run(previous, observation) else previous.last_compute_flops
    compute = max(0.0, observation.compute_flops - base_flops)
    if observation.sync_phase not in COMPUTE_PHASES or observation.swarm_phase not in COMPUTE_PHASES:
        compute = 0.0  # strict: FLOPs counted while the swarm saw no phase 2 never earn, now or later
    return Increment(presence, compute)


def capped_peers(peers: Iterable[PeerState], now: float, policy: PointsPolicy) -> set[str]:
    """Peer ids over their identity's cap among the peers online at ``now`` (ranked by first seen)."""
    by_identity: dict[str, list[PeerState]] = defaultdict(list)
    for peer in peers:
        if peer.online(now, policy):
            by_identity[peer.identity].append(peer)
    over: set[str] = set()
    for group in by_identity.values():
        group.sort(key=lambda peer: (peer.first_seen, peer.peer_id))
        over.update(peer.peer_id for peer in group[policy.identity_cap :])
    return over


def apply_observations(
    peers: dict[str, PeerState], observations: Iterable[Observation], now: float, policy: PointsPolicy
) -> dict[str, PeerState]:
    """Credit one scrape's observations; return the new state of every observed peer.

    ``peers`` is the state before the scrape (not modified). Peers of another identity than the one first
    recorded for their peer id are skipped (a peer id belongs to one identity), and so are records that are not
    fresh: a stale or replayed record neither earns nor keeps its peer online.
    """
    latest: dict[str, Observation] = {}
    for observation in observations:
        known = latest.get(observation.peer_id)
        if known is None or (observation.seen_at, observation.published_at) >= (known.seen_at, known.published_at):
            latest[observation.peer_id] = observation
    latest = {
        peer_id: obs
        for peer_id, obs in latest.items()
        if peer_id not in peers or (peers[peer_id].identity == obs.identity and is_fresh(peers[peer_id], obs))
    }

    # Who is online during this scrape: everyone observed now, plus peers seen recently.
    seen_now = {
        peer_id: (dataclasses.replace(peers[peer_id], last_seen=obs.seen_at) if peer_id in peers else _new_peer(obs))
        for peer_id, obs in latest.items()
    }
    online = {**{pid: p for pid, p in peers.items() if p.online(now, policy)}, **seen_now}
    over_cap = capped_peers(online.values(), now, policy)

    updated: dict[str, PeerState] = {}
    for peer_id, obs in latest.items():
        previous = peers.get(peer_id)
        earned = increments(previous, obs, policy)
        presence, compute = (0.0, 0.0) if peer_id in over_cap else (earned.presence_seconds, earned.compute_flops)
        base = previous or seen_now[peer_id]
        if base.withheld:  # caught lying: the slot it holds serves nothing, so its time there earns no more
            presence = 0.0
        updated[peer_id] = dataclasses.replace(
            base,
            stage=obs.stage,
            last_seen=obs.seen_at,
            sync_phase=obs.sync_phase,
            run_id=obs.run_id,
            last_active_seconds=obs.active_seconds,
            last_compute_flops=obs.compute_flops,
            last_published_at=obs.published_at,
            presence_seconds=base.presence_seconds + presence,
            compute_flops=base.compute_flops + compute,
        )
    return updated


def _new_peer(obs: Observation) -> PeerState:
    return PeerState(
        peer_id=obs.peer_id,
        identity=obs.identity,
        stage=obs.stage,
        first_seen=obs.seen_at,
        last_seen=obs.seen_at,
        sync_phase=obs.sync_phase,
        run_id=obs.run_id,
        last_active_seconds=0.0,
        last_compute_flops=0.0,
        last_published_at=obs.published_at,
    )


def leaderboard(peers: Iterable[PeerState], now: float, policy: PointsPolicy) -> list[LeaderboardRow]:
    """One row per identity: score is presence + verified compute points summed over its peers."""
    by_identity: dict[str, list[PeerState]] = defaultdict(list)
    for peer in peers:
        by_identity[peer.identity].append(peer)
    summaries = []
    for identity, group in by_identity.items():
        summaries.append(
            (
                sum(peer.score for peer in group),
                min(peer.first_seen for peer in group),
                identity,
                sum(peer.presence_seconds for peer in group) / SECONDS_PER_HOUR,
                any(peer.online(now, policy) for peer in group),
                any(peer.over_claimed(policy) for peer in group),
            )
        )
    summaries.sort(key=lambda item: (-item[0], item[1], item[2]))
    return [
        LeaderboardRow(
            rank=rank,
            username=identity,
            active_hours=round(hours, 4),
            joined=datetime.fromtimestamp(joined, tz=timezone.utc).isoformat(timespec="seconds"),
            score=round(score, 6),
            online=online,
            flagged=flagged,
        )
        for rank, (score, joined, identity, hours, online, flagged) in enumerate(summaries, start=1)
    ]
