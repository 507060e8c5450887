"""Points logic: presence and compute accrual, phases, counter resets, the per-identity cap, the leaderboard."""

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

POLICY = PointsPolicy(identity_cap=2, online_window_s=90.0, presence_grace_s=120.0)


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
) -> Observation:
    return Observation(
        peer_id=peer,
        identity=identity,
        stage=stage,
        run_id=run,
        sync_phase=phase,
        active_seconds=active,
        compute_flops=flops,
        seen_at=t,
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

    def score(self, identity: str) -> float:
        return sum(p.score for p in self.peers.values() if p.identity == identity)


def test_compute_is_the_sum_of_counter_increments_and_presence_one_pflop_per_hour():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, active=0, flops=0))
    ledger.scrape(1800, obs("p1", 1800, active=1800, flops=2 * PFLOP))
    ledger.scrape(3600, obs("p1", 3600, active=3600, flops=5 * PFLOP))
    peer = ledger.peers["p1"]
    assert peer.presence_points == pytest.approx(1.0)
    assert peer.compute_points == pytest.approx(5.0)
    assert peer.score == pytest.approx(6.0)


def test_presence_accrues_in_phase_1_and_compute_only_from_phase_2():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, phase="sync1", active=0))
    # FLOPs reported during phase 1 (which should not happen) earn nothing, now or later.
    ledger.scrape(600, obs("p1", 600, phase="sync1", active=600, flops=3 * PFLOP))
    assert ledger.peers["p1"].compute_flops == 0
    assert ledger.peers["p1"].presence_seconds == pytest.approx(600)
    ledger.scrape(1200, obs("p1", 1200, phase="sync2", active=1200, flops=4 * PFLOP))
    assert ledger.peers["p1"].compute_points == pytest.approx(1.0)  # only the FLOPs after phase 1's 3 PFLOP
    ledger.scrape(1800, obs("p1", 1800, phase="active", active=1800, flops=6 * PFLOP))
    assert ledger.peers["p1"].compute_points == pytest.approx(3.0)
    assert ledger.peers["p1"].presence_points == pytest.approx(0.5)


def test_two_peers_of_one_identity_add_up():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0), obs("p2", 0, stage="head"))
    ledger.scrape(
        3600, obs("p1", 3600, active=3600, flops=2 * PFLOP), obs("p2", 3600, active=3600, flops=3 * PFLOP, stage="head")
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
    ledger.scrape(
        3620,
        obs("p1", 3620, active=3620, flops=PFLOP),
        obs("p2", 3620, active=3610, flops=PFLOP),
        obs("p3", 3620, active=3600, flops=50 * PFLOP),
    )
    assert ledger.peers["p3"].score == 0
    assert ledger.peers["p1"].score > 1 and ledger.peers["p2"].score > 1
    # p1 leaves (not seen for longer than the online window): p3 now earns, but only what comes next.
    ledger.scrape(3800, obs("p2", 3800, active=3790, flops=PFLOP), obs("p3", 3800, active=3780, flops=51 * PFLOP))
    assert ledger.peers["p3"].compute_points == pytest.approx(1.0)
    assert ledger.peers["p3"].presence_seconds == pytest.approx(180)


def test_another_identity_is_not_capped_by_alice():
    ledger = Ledger()
    ledger.scrape(0, obs("a1", 0), obs("a2", 0), obs("b1", 0, identity="bob"))
    ledger.scrape(
        100, obs("a1", 100, flops=PFLOP), obs("a2", 100, flops=PFLOP), obs("b1", 100, identity="bob", flops=PFLOP)
    )
    assert ledger.score("bob") == pytest.approx(1.0)
    assert ledger.score("alice") == pytest.approx(2.0)


def test_a_disconnect_loses_nothing_and_a_worker_restart_counts_its_new_run_from_zero():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0))
    ledger.scrape(100, obs("p1", 100, active=100, flops=4 * PFLOP))
    # Gone for an hour, then seen again with the same run: what it did meanwhile counts.
    ledger.scrape(3700, obs("p1", 3700, active=3700, flops=10 * PFLOP))
    assert ledger.peers["p1"].compute_points == pytest.approx(10.0)
    assert ledger.peers["p1"].presence_seconds == pytest.approx(3700)
    # Restarted worker: lower counter, same run id -> a new run, its whole counter is new work.
    ledger.scrape(3800, obs("p1", 3800, active=50, flops=1 * PFLOP))
    assert ledger.peers["p1"].compute_points == pytest.approx(11.0)
    # Restarted again and already past the old counter: the new run id still says so.
    ledger.scrape(3900, obs("p1", 3900, active=40, flops=2 * PFLOP, run="run-2"))
    assert ledger.peers["p1"].compute_points == pytest.approx(13.0)
    assert ledger.peers["p1"].presence_seconds == pytest.approx(3700 + 50 + 40)


def test_a_stale_record_seen_again_credits_nothing():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, active=5, flops=PFLOP))
    before = ledger.peers["p1"]
    for t in (10, 20, 30):
        ledger.scrape(t, obs("p1", t, active=5, flops=PFLOP))
    assert ledger.peers["p1"].score == pytest.approx(before.score)


def test_presence_cannot_outrun_the_time_the_monitor_watched_the_run():
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, active=10_000))  # claims hours on first sight: only the grace is credited
    assert ledger.peers["p1"].presence_seconds == pytest.approx(POLICY.presence_grace_s)
    ledger.scrape(60, obs("p1", 60, active=20_000))
    assert ledger.peers["p1"].presence_seconds == pytest.approx(POLICY.presence_grace_s + 60)
    # An honest worker publishing less often than the monitor scrapes loses nothing.
    ledger = Ledger()
    ledger.scrape(0, obs("p1", 0, active=0))
    for t in (10, 20):
        ledger.scrape(t, obs("p1", t, active=0))
    ledger.scrape(30, obs("p1", 30, active=30))
    assert ledger.peers["p1"].presence_seconds == pytest.approx(30)


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
