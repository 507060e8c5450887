"""Points logic: presence and compute accrual, phases, counter resets, the per-identity cap, the leaderboard; and the
ways a stranger could game them (test_gaming_*)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agora_client.monitor.points import (
    PFLOP,
    Observation,
    PeerState,
    PointsPolicy,
    apply_observations,
    leaderboard,
)

POLICY = PointsPolicy(identity_cap=2, online_window_s=90.0)


def obs(
    peer: str,
    t: float,
    *,
    identity: str = "alice",
    phase: str = "active",
    active: float = 0.0,
    flops: float = 0.0,
    run: str = "run-1",
    stage: str = "body1",
    published: float | None = None,
    swarm: str | None = "same",
) -> Observation:
    """``published``: the record's own timestamp (default ``t``: a fresh record); ``swarm``: the phase the stage's
    roster shows (default: the claimed one; None: not in the roster)."""
    return Observation(
        peer_id=peer,
        identity=identity,
        stage=stage,
        run_id=run,
        sync_phase=phase,
        active_seconds=active,
        compute_flops=flops,
        seen_at=t,
        published_at=t if published is None else published,
        swarm_phase=phase if swarm == "same" else swarm,
    )


class Ledger:
    """Feeds scrapes through apply_observations the way the store does, keeping the state in memory. Trainers'
    receipts vouch for every claim here, so verified compute is the claim the rules accept (receipts that vouch
    for less: test_receipts.py)."""

    def __init__(self, policy: PointsPolicy = POLICY) -> None:
        self.policy = policy
        self.peers: dict[str, PeerState] = {}

    def scrape(self, now: float, *observations: Observation) -> None:
        updated = apply_observations(self.peers, observations, now, self.policy)
        self.peers.update(
            {peer_id: replace(peer, receipted_flops=peer.compute_flops) for peer_id, peer in updated.items()}
        )

    def every(self, start: float, end: float, step: float, *make) -> None:
        """One scrape every ``step`` seconds from ``start`` to ``end``; each ``make(t)`` gives a peer's record."""
        t = start
        while t <= end:
            self.scrape(t, *(item(t) for item in make))
            t += step

    def score(self, identity: str) -> float:
        return sum(p.score for p in self.peers.values() if p.identity == identity)


def test_compute_is_the_sum_of_counter_increments_and_presence_one_pflop_per_hour():
    ledger = Ledger()
    ledger.every(0, 3600, 30, lambda t: obs("p1", t, active=t, flops=5 * PFLOP * t / 3600))
    peer = ledger.peers["p1"]
    assert peer.presence_points == pytest.approx(1.0)
    assert peer.compute_points == pytest.approx(5.0)
    assert peer.score == pytest.approx(6.0)


def test_presence_accrues_in_phase_1_and_compute_only_from_phase_2():
    ledger = Ledger()
    ledger.every(0, 600, 60, lambda t: obs("p1", t, phase="sync1", active=t, flops=3 * PFLOP * t / 600))
    # FLOPs reported during phase 1 (which should not happen) earn nothing, now or later.
    assert ledger.peers["p1"].compute_flops == 0
    assert ledger.peers["p1"].presence_seconds == pytest.approx(600)
    ledger.every(
        660, 1200, 60, lambda t: obs("p1", t, phase="sync2", active=t, flops=3 * PFLOP + PFLOP * (t - 600) / 600)
    )
    assert ledger.peers["p1"].compute_points == pytest.approx(1.0)  # only the FLOPs after phase 1's 3 PFLOP
    ledger.every(1260, 1800, 60, lambda t: obs("p1", t, active=t, flops=4 * PFLOP + 2 * PFLOP * (t - 1200) / 600))
    assert ledger.peers["p1"].compute_points == pytest.approx(3.0)
    assert ledger.peers["p1"].presence_points == pytest.approx(0.5)


def test_two_peers_of_one_identity_add_up():
    ledger = Ledger()
    ledger.every(
        0,
        3600,
        60,
        lambda t: obs("p1", t, active=t, flops=2 * PFLOP * t / 3600),
        lambda t: obs("p2", t, active=t, flops=3 * PFLOP * t / 3600, stage="head"),
    )
    assert ledger.score("alice") == pytest.approx(2 * 1.0 + 2.0 + 3.0)
    rows = leaderboard(ledger.peers.values(), 3600, POLICY)
    assert [(row.username, row.score) for row in rows] == [("alice", pytest.approx(7.0))]
    assert rows[0].active_hours == pytest.approx(2.0)


def test_a_peer_over_the_cap_earns_nothing_and_earns_again_once_a_slot_frees():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0))
    ledger.scrape(10, obs("p1", 10, active=10), obs("p2", 10))
    ledger.scrape(20, obs("p1", 20, active=20), obs("p2", 20, active=10), obs("p3", 20))  # p3 is third, by first seen
    ledger.every(
        80,
        3620,
        60,
        lambda t: obs("p1", t, active=t, flops=PFLOP * t / 3620),
        lambda t: obs("p2", t, active=t, flops=PFLOP * t / 3620),
        lambda t: obs("p3", t, active=t, flops=50 * PFLOP * t / 3620),
    )
    assert ledger.peers["p3"].score == 0
    assert ledger.peers["p1"].score > 1 and ledger.peers["p2"].score > 1
    # p1 leaves (not seen for longer than the online window): p3 now earns, but only what comes next.
    ledger.every(
        3680, 3800, 60, lambda t: obs("p2", t, flops=PFLOP), lambda t: obs("p3", t, flops=51 * PFLOP * t / 3800)
    )
    # At 3740 s p1 is offline: p3 is credited the increments since its 3680 s sighting.
    assert ledger.peers["p3"].compute_points == pytest.approx(51 * 120 / 3800)
    assert ledger.peers["p3"].presence_seconds == pytest.approx(120)


def test_another_identity_is_not_capped_by_alice():
    ledger = Ledger()
    ledger.scrape(0, obs("a1", 0), obs("a2", 0), obs("b1", 0, identity="bob"))
    ledger.scrape(
        100, obs("a1", 100, flops=PFLOP), obs("a2", 100, flops=PFLOP), obs("b1", 100, identity="bob", flops=PFLOP)
    )
    assert ledger.score("bob") == pytest.approx(1.0)
    assert ledger.score("alice") == pytest.approx(2.0)


def test_a_disconnect_keeps_compute_and_loses_only_the_gap_and_a_restart_counts_its_new_run_from_zero():
    ledger = Ledger()
    ledger.every(0, 100, 50, lambda t: obs("p1", t, active=t, flops=4 * PFLOP * t / 100))
    # Gone for an hour, then seen again with the same run: the compute it did meanwhile counts, the hour unseen earns
    # no presence.
    ledger.scrape(3700, obs("p1", 3700, active=3700, flops=10 * PFLOP))
    assert ledger.peers["p1"].compute_points == pytest.approx(10.0)
    assert ledger.peers["p1"].presence_seconds == pytest.approx(100)
    # Crashed and rejoined within the online window: a lower counter is a new run, its whole counter is new work,
    # and the monitor saw it live across the restart.
    ledger.scrape(3760, obs("p1", 3760, active=50, flops=1 * PFLOP))
    assert ledger.peers["p1"].compute_points == pytest.approx(11.0)
    # Restarted again and already past the old counter: the new run id still says so.
    ledger.scrape(3820, obs("p1", 3820, active=40, flops=2 * PFLOP, run="run-2"))
    assert ledger.peers["p1"].compute_points == pytest.approx(13.0)
    assert ledger.peers["p1"].presence_seconds == pytest.approx(100 + 60 + 60)


def test_a_stale_record_seen_again_credits_nothing():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, active=5, flops=PFLOP))
    before = ledger.peers["p1"]
    for t in (10, 20, 30):
        ledger.scrape(t, obs("p1", t, active=5, flops=PFLOP, published=0))
    assert ledger.peers["p1"].score == pytest.approx(before.score)


def test_presence_is_the_time_the_monitor_saw_the_peer_whatever_it_claims():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, active=10_000))  # claims hours on first sight: it earns nothing yet
    assert ledger.peers["p1"].presence_seconds == 0
    ledger.scrape(60, obs("p1", 60, active=20_000))
    assert ledger.peers["p1"].presence_seconds == pytest.approx(60)
    # An honest worker publishing less often than the monitor scrapes loses nothing: a record seen again is not
    # fresh, and the next fresh one covers the whole time since the last.
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0))
    for t in (10, 20):
        ledger.scrape(t, obs("p1", t, published=0))
    ledger.scrape(30, obs("p1", 30))
    assert ledger.peers["p1"].presence_seconds == pytest.approx(30)


def test_a_peer_missing_from_its_stage_roster_earns_no_presence():
    ledger = Ledger()
    ledger.every(0, 600, 30, lambda t: obs("p1", t, phase="sync1", active=t, swarm=None))
    assert ledger.peers["p1"].presence_seconds == 0


def test_gaming_rotating_run_ids():
    """A worker that puts a fresh run id in every record earns what an honest one does over an hour of scrapes
    every 10 s (issue 46: it earned 12.0x)."""
    ledger = Ledger()
    ledger.every(
        0,
        3600,
        10,
        lambda t: obs("honest", t, active=t, flops=0.0),
        lambda t: obs("rotator", t, identity="mallory", active=t, run=f"run-{t}", flops=0.0),
    )
    honest, rotator = ledger.peers["honest"].presence_seconds, ledger.peers["rotator"].presence_seconds
    assert honest == pytest.approx(3600)
    assert rotator <= honest


def test_gaming_counter_reset():
    """Reporting a counter lower than last time (a 'restart' in every record) earns no fresh grace."""
    ledger = Ledger()
    ledger.every(
        0,
        3600,
        10,
        lambda t: obs("honest", t, active=t),
        lambda t: obs("resetter", t, identity="mallory", active=1000.0 if int(t) % 20 else 0.0),
    )
    assert ledger.peers["resetter"].presence_seconds <= ledger.peers["honest"].presence_seconds == pytest.approx(3600)


def test_gaming_phase_claim():
    """A worker claims phase 2 while its stage's roster (what trainers route on) keeps it in phase 1: the compute it
    claims earns nothing, even where its receipts from an earlier run would cover it."""
    ledger = Ledger()
    ledger.every(0, 600, 60, lambda t: obs("p1", t, active=t, flops=2 * PFLOP * t / 600))
    # Receipts for more than it claimed (its last increments were lost in a crash): 3 PFLOP of slack.
    ledger.peers["p1"] = replace(ledger.peers["p1"], receipted_flops=5 * PFLOP)
    for t in range(660, 1260, 60):
        updated = apply_observations(
            ledger.peers,
            [obs("p1", t, phase="sync2", swarm="sync1", run="run-2", flops=3 * PFLOP * (t - 600) / 600)],
            t,
            POLICY,
        )
        ledger.peers.update(updated)
    assert ledger.peers["p1"].compute_points == pytest.approx(2.0)
    assert ledger.peers["p1"].presence_seconds == pytest.approx(1200)  # phase 1 is present, all the same


def test_gaming_replayed_record():
    """Two genuine signed records of one run replayed in turn (the older one looks like a counter reset) earn
    nothing after they were first credited."""
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0))
    first, second = obs("p1", 60, active=60, flops=PFLOP), obs("p1", 120, active=120, flops=2 * PFLOP)
    ledger.scrape(60, first)
    ledger.scrape(120, second)
    earned = ledger.peers["p1"].score
    for t in range(130, 3600, 10):
        record = first if (t // 10) % 2 else second
        ledger.scrape(t, replace(record, seen_at=t))
    assert ledger.peers["p1"].score == pytest.approx(earned)
    assert not ledger.peers["p1"].online(3600, POLICY)  # a replayed record keeps no one online


def test_a_peer_id_stays_with_its_first_identity():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0))
    ledger.scrape(10, obs("p1", 10, identity="mallory", flops=PFLOP))
    assert ledger.peers["p1"].identity == "alice"
    assert ledger.peers["p1"].compute_flops == 0


def test_leaderboard_ranks_by_score_and_reports_online():
    ledger = Ledger()
    ledger.scrape(0, obs("a1", 0), obs("b1", 0, identity="bob"))
    ledger.scrape(100, obs("a1", 100, flops=PFLOP), obs("b1", 100, identity="bob", flops=3 * PFLOP))
    ledger.scrape(300, obs("a1", 300, flops=PFLOP))
    rows = leaderboard(ledger.peers.values(), 300, POLICY)
    assert [(r.rank, r.username, r.online) for r in rows] == [(1, "bob", False), (2, "alice", True)]
    assert rows[0].joined == "1970-01-01T00:00:00+00:00"
