"""The SQLite ledger and the leaderboard HTTP API: restarts lose no total and count nothing twice; the learning
curve keeps each trainer's point once and is served as stored."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agora_client.discovery.progress_records import TrainerProgress
from agora_client.discovery.signed_records import Receipt, ServedCounts
from agora_client.monitor.estimate import fetch_confirmed
from agora_client.monitor.http_api import LeaderboardServer
from agora_client.monitor.leaderboard_cli import fetch_rows, format_table
from agora_client.monitor.learning import LearningPoint, learning_points
from agora_client.monitor.points import PFLOP, Observation, PointsPolicy
from agora_client.monitor.store import _SCHEMA, PointsStore

REPO = Path(__file__).resolve().parents[1]
POLICY = PointsPolicy(identity_cap=2, online_window_s=90.0)


def obs(
    peer: str, t: float, active: float, flops: float, identity: str = "alice", published: float | None = None
) -> Observation:
    return Observation(
        peer_id=peer,
        identity=identity,
        stage="head",
        run_id="r1",
        sync_phase="active",
        active_seconds=active,
        compute_flops=flops,
        seen_at=t,
        published_at=t if published is None else published,
        swarm_phase="active",
    )


def vouch(store: PointsStore, **flops_by_peer: float) -> None:
    """A ticketed trainer's receipts for these peers (the monitor checked its signature and ticket)."""
    served = {
        peer: ServedCounts(stage="head", forwards=1, backwards=1, flops=flops) for peer, flops in flops_by_peer.items()
    }
    store.record_receipts([Receipt(trainer="QmTrainer", ticket="t", run_id="r1", served=served, ts=0.0)])


def test_a_reopened_store_keeps_every_total_and_does_not_recredit(tmp_path):
    db = tmp_path / "points.sqlite"
    store = PointsStore(db, POLICY)
    vouch(store, p1=5 * PFLOP, p2=PFLOP)
    store.record_scrape([obs("p1", 0, 0, 0), obs("p2", 0, 0, 0)], {}, now=0)
    store.record_scrape([obs("p1", 60, 60, 2 * PFLOP), obs("p2", 60, 60, PFLOP)], {"p1": '{"x": 1}'}, now=60)
    before = store.peers()
    store.close()

    store = PointsStore(db, POLICY)  # the monitor restarted
    assert store.peers() == before
    # The same records read again after the restart credit nothing more.
    store.record_scrape(
        [obs("p1", 70, 60, 2 * PFLOP, published=60), obs("p2", 70, 60, PFLOP, published=60)], {}, now=70
    )
    assert store.peer("p1").score == pytest.approx(before["p1"].score)
    # The monitor was down for an hour: the compute counter kept running and loses nothing; presence is what the
    # monitor saw live, so the hour it did not watch earns none.
    store.record_scrape([obs("p1", 3670, 3660, 5 * PFLOP)], {}, now=3670)
    assert store.peer("p1").compute_points == pytest.approx(5.0)
    assert store.peer("p1").presence_seconds == pytest.approx(60)
    rows = store.leaderboard(now=3670)
    assert rows[0].username == "alice"
    assert rows[0].score == pytest.approx(60 / 3600 + 5 + 60 / 3600 + 1, rel=1e-6)
    store.close()


def test_a_failed_scrape_writes_nothing(tmp_path):
    store = PointsStore(tmp_path / "points.sqlite", POLICY)
    vouch(store, p1=PFLOP)
    store.record_scrape([obs("p1", 0, 0, PFLOP)], {}, now=0)
    with pytest.raises(sqlite3.ProgrammingError):  # p1 is written first, then p2 fails: all rolled back
        store.record_scrape([obs("p1", 10, 10, 2 * PFLOP), obs("p2", 10, 0, 0)], {"p2": object()}, now=10)
    assert store.peer("p2") is None
    assert store.peer("p1").compute_points == pytest.approx(1.0)
    store.close()


def test_leaderboard_endpoint_survives_a_restart_and_the_cli_prints_a_table(tmp_path):
    db = tmp_path / "points.sqlite"
    store = PointsStore(db, POLICY)
    vouch(store, a1=3 * PFLOP, b1=PFLOP)
    store.record_scrape([obs("a1", 0, 0, 0), obs("b1", 0, 0, 0, identity="bob")], {}, now=0)
    store.record_scrape([obs("a1", 60, 60, 3 * PFLOP), obs("b1", 60, 60, PFLOP, identity="bob")], {}, now=60)
    server = LeaderboardServer(store, "127.0.0.1", 0, clock=lambda: 100.0).start()
    try:
        reply = httpx.get(f"{server.url}/leaderboard", timeout=5).json()
        peer = httpx.get(f"{server.url}/peers/a1", timeout=5).json()
        missing = httpx.get(f"{server.url}/peers/nobody", timeout=5)
        confirmed = fetch_confirmed(server.url, "a1"), fetch_confirmed(server.url, "nobody")
    finally:
        server.stop()
        store.close()
    rows = reply["rows"]
    assert [(r["rank"], r["username"], r["online"]) for r in rows] == [(1, "alice", True), (2, "bob", True)]
    assert rows[0]["score"] == pytest.approx(3 + 60 / 3600, rel=1e-6)
    assert rows[0]["active_hours"] == pytest.approx(60 / 3600, abs=1e-4)
    assert rows[0]["joined"] == "1970-01-01T00:00:00+00:00"
    assert peer["identity"] == "alice" and peer["compute"] == pytest.approx(3.0) == peer["claimed_compute"]
    assert peer["flagged"] is False and rows[0]["flagged"] is False
    assert missing.status_code == 404 and "no verified metrics" in missing.json()["error"]
    assert confirmed[0].score == pytest.approx(peer["score"]) and confirmed[1] is None
    assert (confirmed[0].verified_compute, confirmed[0].claimed_compute, confirmed[0].flagged) == (
        pytest.approx(3.0),
        pytest.approx(3.0),
        False,
    )
    assert fetch_confirmed(server.url, "a1", timeout=1) is None  # the monitor is down now

    store = PointsStore(db, POLICY)  # a new service process on the same file
    server = LeaderboardServer(store, "127.0.0.1", 0, clock=lambda: 1000.0).start()
    try:
        again = httpx.get(f"{server.url}/leaderboard", timeout=5).json()["rows"]
        printed = subprocess.run(
            [sys.executable, str(REPO / "agora_cli.py"), "leaderboard", "--url", server.url],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    finally:
        server.stop()
        store.close()
    assert [(r["username"], r["score"]) for r in again] == [(r["username"], r["score"]) for r in rows]
    assert not any(r["online"] for r in again)  # nobody seen for 940 s
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.strip().splitlines()
    assert lines[0].split() == ["Rank", "User", "Score", "(PFLOP)", "Active", "h", "Joined", "Status", "Check"]
    assert lines[2].split()[:3] == ["1", "alice", "3.017"] and lines[2].split()[-1] == "offline"
    assert lines[3].split()[:3] == ["2", "bob", "1.017"]


def test_the_leaderboard_ranks_by_verified_points_not_by_claims(tmp_path):
    """bob claims 10 PFLOPs, trainers receipted 1 of them; alice claims and was receipted 3: alice ranks first."""
    store = PointsStore(tmp_path / "points.sqlite", POLICY)
    vouch(store, a1=3 * PFLOP, b1=PFLOP)
    store.record_scrape([obs("a1", 0, 0, 0), obs("b1", 0, 0, 0, identity="bob")], {}, now=0)
    store.record_scrape([obs("a1", 60, 60, 3 * PFLOP), obs("b1", 60, 60, 10 * PFLOP, identity="bob")], {}, now=60)
    server = LeaderboardServer(store, "127.0.0.1", 0, clock=lambda: 100.0).start()
    try:
        rows = fetch_rows(server.url)  # what `agora leaderboard` prints, in the monitor's order
        bob = httpx.get(f"{server.url}/peers/b1", timeout=5).json()
    finally:
        server.stop()
        store.close()
    assert [(row["rank"], row["username"], row["flagged"]) for row in rows] == [(1, "alice", False), (2, "bob", True)]
    assert rows[1]["score"] == pytest.approx(1 + 60 / 3600, rel=1e-6)
    assert (bob["compute"], bob["claimed_compute"], bob["flagged"]) == (pytest.approx(1.0), pytest.approx(10.0), True)
    table = format_table(rows).splitlines()
    assert table[2].split()[:2] == ["1", "alice"] and table[3].split()[:2] == ["2", "bob"]
    assert table[3].endswith("claims more than trainers receipted") and "receipted" not in table[2]


def test_leaderboard_cli_says_what_to_do_when_the_monitor_is_down():
    printed = subprocess.run(
        [sys.executable, str(REPO / "agora_cli.py"), "leaderboard", "--url", "http://127.0.0.1:9", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert printed.returncode == 1
    assert "could not reach the monitor" in printed.stderr and "Traceback" not in printed.stderr
    assert format_table([]).startswith("No contributors yet")


def learning_point(trainer: str, series: str, ts: float, value: float) -> LearningPoint:
    return LearningPoint(trainer=trainer, series=series, ts=ts, value=value)


def test_learning_points_are_kept_once_and_survive_a_restart(tmp_path):
    db = tmp_path / "points.sqlite"
    store = PointsStore(db, POLICY)
    first = [
        learning_point("t1", "loss", 10.0, 5.0),
        learning_point("t1", "eval_loss", 12.0, 5.3),
        learning_point("t2", "loss", 11.0, 4.8),
    ]
    assert store.record_learning(first) == 3
    # the next scrape reads the same histories again, with one new point of each series
    again = [*first, learning_point("t1", "loss", 20.0, 4.5), learning_point("t1", "eval_loss", 22.0, 5.1)]
    assert store.record_learning(again) == 2
    store.close()

    store = PointsStore(db, POLICY)  # the monitor restarted
    assert store.record_learning(again) == 0
    assert store.learning() == {
        "loss": [(10.0, 5.0), (11.0, 4.8), (20.0, 4.5)],
        "eval_loss": [(12.0, 5.3), (22.0, 5.1)],
    }
    store.close()


def test_learning_points_come_from_the_trainers_histories_without_non_finite_losses():
    records = [
        TrainerProgress(
            peer_id="t1",
            microbatches=4,
            loss=4.0,
            history=[(1.0, 5.0), (2.0, float("nan"))],
            eval_loss=4.2,
            eval_history=[(1.5, 4.2)],
            ts=2.0,
        ),
        TrainerProgress(peer_id="t2", microbatches=2, history=[(3.0, float("inf"))], ts=3.0),
    ]
    assert learning_points(records) == [
        learning_point("t1", "loss", 1.0, 5.0),
        learning_point("t1", "eval_loss", 1.5, 4.2),
    ]


def test_learning_endpoint_serves_the_stored_curves(tmp_path):
    store = PointsStore(tmp_path / "points.sqlite", POLICY)
    server = LeaderboardServer(store, "127.0.0.1", 0).start()
    try:
        empty = httpx.get(f"{server.url}/learning", timeout=5)
        store.record_learning(
            [
                learning_point("t2", "loss", 11.0, 4.8),
                learning_point("t1", "loss", 10.0, 5.0),
                learning_point("t1", "eval_loss", 12.0, 5.3),
            ]
        )
        reply = httpx.get(f"{server.url}/learning", timeout=5)
    finally:
        server.stop()
        store.close()
    assert empty.status_code == 200 and empty.json() == {"loss": [], "eval_loss": []}
    assert reply.status_code == 200
    assert reply.json() == {"loss": [[10.0, 5.0], [11.0, 4.8]], "eval_loss": [[12.0, 5.3]]}  # merged, oldest first


OBSERVATIONS_BEFORE_OBSERVED_PRESENCE = """
CREATE TABLE observations (
    peer_id TEXT PRIMARY KEY REFERENCES peers(peer_id),
    run_id TEXT NOT NULL,
    run_first_seen REAL NOT NULL,
    run_presence_seconds REAL NOT NULL,
    active_seconds REAL NOT NULL,
    compute_flops REAL NOT NULL,
    record_json TEXT NOT NULL
);
"""


def test_a_ledger_from_before_observed_presence_opens_with_its_totals(tmp_path):
    db = tmp_path / "points.sqlite"
    old = sqlite3.connect(db)
    old.executescript(OBSERVATIONS_BEFORE_OBSERVED_PRESENCE + _SCHEMA)
    old.execute("INSERT INTO identities VALUES ('alice', 0)")
    old.execute("INSERT INTO peers VALUES ('p1', 'alice', 'head', 0, 60, 'active')")
    old.execute("INSERT INTO observations VALUES ('p1', 'r1', 0, 60, 60, 0, '{}')")
    old.execute("INSERT INTO totals VALUES ('p1', 60, 0)")
    old.commit()
    old.close()
    store = PointsStore(db, POLICY)
    peer = store.peer("p1")
    assert (peer.presence_seconds, peer.last_published_at) == (60, 0)  # the next record is fresh
    store.record_scrape([obs("p1", 120, 120, 0)], {}, now=120)
    assert store.peer("p1").presence_seconds == pytest.approx(120)
    store.close()


def test_a_ledger_from_before_escrow_keeps_every_receipted_flop_payable(tmp_path):
    path = tmp_path / "points.sqlite"
    with sqlite3.connect(path) as old:  # the receipts table as monitors wrote it before escrow
        old.execute(
            "CREATE TABLE receipts (trainer TEXT NOT NULL, run_id TEXT NOT NULL, peer_id TEXT NOT NULL, "
            "flops REAL NOT NULL, PRIMARY KEY (trainer, run_id, peer_id)) WITHOUT ROWID"
        )
        old.execute("INSERT INTO receipts VALUES ('trainer', 'run', 'p1', ?)", (3 * PFLOP,))
    store = PointsStore(path)
    try:
        assert store.escrow().held_flops == store.escrow().forfeited_flops == 0
        with sqlite3.connect(path) as db:  # every FLOP receipted before escrow was payable
            assert db.execute("SELECT flops, payable FROM receipts").fetchall() == [(3 * PFLOP, 3 * PFLOP)]
        counts = ServedCounts(stage="body1", forwards=1, backwards=1, flops=5 * PFLOP, held_flops=PFLOP)
        store.record_receipts([Receipt(trainer="trainer", ticket="-", run_id="run", served={"p1": counts}, ts=1.0)])
        assert store.escrow().held_flops == PFLOP
    finally:
        store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT flops, payable FROM receipts").fetchall() == [(5 * PFLOP, 4 * PFLOP)]
