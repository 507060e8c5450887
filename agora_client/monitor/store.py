"""Durable points: SQLite (WAL) holding identities, peers, each peer's last observation and its totals, the
trainers' receipts (the highest count per trainer process and worker, see monitor/receipts.py); the
swarm's learning curve (the trainers' loss and held-out eval-loss points, see monitor/learning.py); and each
identity's points over time (monitor/history.py). The latest scrape's swarm summary (monitor/swarm_summary.py)
is kept in memory only: the next scrape rebuilds it.

Every scrape is applied in one transaction that writes the new totals together with the
counters they were computed from, so a monitor restarted at any moment neither loses a
total nor credits the same increment twice.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agora_client.discovery.signed_records import Receipt
from agora_client.monitor.history import HistoryPoint, bucket_of, identity_totals, oldest_bucket_kept
from agora_client.monitor.learning import SERIES, LearningPoint
from agora_client.monitor.points import (
    LeaderboardRow,
    Observation,
    PeerState,
    PointsPolicy,
    apply_observations,
    leaderboard,
)
from agora_client.monitor.swarm_summary import SwarmSummary

DEFAULT_POLICY = PointsPolicy()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS identities (
    identity TEXT PRIMARY KEY,
    joined REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY,
    identity TEXT NOT NULL REFERENCES identities(identity),
    stage TEXT NOT NULL,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    sync_phase TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS observations (
    peer_id TEXT PRIMARY KEY REFERENCES peers(peer_id),
    run_id TEXT NOT NULL,
    published_at REAL NOT NULL,
    active_seconds REAL NOT NULL,
    compute_flops REAL NOT NULL,
    record_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS totals (
    peer_id TEXT PRIMARY KEY REFERENCES peers(peer_id),
    presence_seconds REAL NOT NULL,
    compute_flops REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS withheld (
    peer_id TEXT PRIMARY KEY,
    since REAL NOT NULL,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS receipts (
    trainer TEXT NOT NULL,
    run_id TEXT NOT NULL,
    peer_id TEXT NOT NULL,
    flops REAL NOT NULL,
    payable REAL NOT NULL,
    held REAL NOT NULL DEFAULT 0,
    forfeited REAL NOT NULL DEFAULT 0,
    disputed INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (trainer, run_id, peer_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS learning (
    trainer TEXT NOT NULL,
    series TEXT NOT NULL,
    ts REAL NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (trainer, series, ts)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS history (
    identity TEXT NOT NULL,
    bucket INTEGER NOT NULL,
    ts REAL NOT NULL,
    presence REAL NOT NULL,
    compute REAL NOT NULL,
    PRIMARY KEY (identity, bucket)
) WITHOUT ROWID;
"""

_LOAD = """
SELECT p.peer_id, p.identity, p.stage, p.first_seen, p.last_seen, p.sync_phase,
       o.run_id, o.active_seconds, o.compute_flops, t.presence_seconds, t.compute_flops,
       o.published_at, w.peer_id IS NOT NULL, COALESCE(r.flops, 0), COALESCE(r.unpaid, 0)
FROM peers p JOIN observations o USING (peer_id) JOIN totals t USING (peer_id) LEFT JOIN withheld w USING (peer_id)
LEFT JOIN (SELECT peer_id, SUM(flops) AS flops, SUM(flops - payable) AS unpaid FROM receipts GROUP BY peer_id) r
USING (peer_id)
"""

_ESCROW = "SELECT COALESCE(SUM(held), 0), COALESCE(SUM(forfeited), 0), COALESCE(SUM(disputed), 0) FROM receipts"


@dataclass(frozen=True)
class EscrowTotals:
    """Compute the trainers' receipts hold in escrow, what escrow forfeited, and its disputed windows (all peers)."""

    held_flops: float
    forfeited_flops: float
    disputed_windows: int


# Served, payable, forfeited and disputed only grow within a trainer process; held is the newest receipt's.
_UPSERT_RECEIPT = """
INSERT INTO receipts (trainer, run_id, peer_id, flops, payable, held, forfeited, disputed)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(trainer, run_id, peer_id) DO UPDATE SET
    held = CASE WHEN excluded.flops >= flops AND excluded.payable >= payable THEN excluded.held ELSE held END,
    flops = MAX(flops, excluded.flops), payable = MAX(payable, excluded.payable),
    forfeited = MAX(forfeited, excluded.forfeited), disputed = MAX(disputed, excluded.disputed)
"""


class PointsStore:
    """The monitor's ledger on disk. Thread-safe: the scraper writes while HTTP handlers read."""

    def __init__(self, path: Path | str, policy: PointsPolicy = DEFAULT_POLICY) -> None:
        self.path = Path(path)
        self.policy = policy
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        _migrate(self._db)
        _migrate_receipts(self._db)
        self._db.executescript(_SCHEMA)
        self._summary: SwarmSummary | None = None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def peers(self) -> dict[str, PeerState]:
        with self._lock:
            return self._load()

    def peer(self, peer_id: str) -> PeerState | None:
        return self.peers().get(peer_id)

    def record_scrape(
        self, observations: Iterable[Observation], records_json: dict[str, str], now: float
    ) -> dict[str, PeerState]:
        """Credit one scrape and persist it atomically.

        ``records_json`` maps peer id -> the raw record kept as last observation."""
        with self._lock:
            before = self._load()
            updated = apply_observations(before, observations, now, self.policy)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for peer in updated.values():
                    self._write(peer, records_json.get(peer.peer_id, "{}"))
                self._write_history({**before, **updated}.values(), {peer.identity for peer in updated.values()}, now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return updated

    def withhold(self, peer_id: str, reason: str, now: float) -> bool:
        """Withhold a peer's compute points, and its presence from now on (also if it was never seen yet); True if
        it is new."""
        with self._lock:
            cursor = self._db.execute(
                "INSERT OR IGNORE INTO withheld (peer_id, since, reason) VALUES (?, ?, ?)", (peer_id, now, reason)
            )
            return cursor.rowcount == 1

    def record_receipts(self, receipts: Iterable[Receipt]) -> None:
        """Keep each trainer process's highest count per worker (its counters only grow; one transaction)."""
        rows = [
            (
                receipt.trainer,
                receipt.run_id,
                peer_id,
                counts.flops,
                counts.payable_flops,
                counts.held_flops,
                counts.forfeited_flops,
                counts.disputed_windows,
            )
            for receipt in receipts
            for peer_id, counts in receipt.served.items()
        ]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(_UPSERT_RECEIPT, rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def escrow(self) -> EscrowTotals:
        with self._lock:
            held, forfeited, disputed = self._db.execute(_ESCROW).fetchone()
        return EscrowTotals(held, forfeited, int(disputed))

    def record_learning(self, points: Iterable[LearningPoint]) -> int:
        """Keep the points not stored yet (one transaction); how many were new."""
        rows = [(point.trainer, point.series, point.ts, point.value) for point in points]
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO learning (trainer, series, ts, value) VALUES (?, ?, ?, ?)", rows
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return self._db.total_changes - before

    def learning(self) -> dict[str, list[tuple[float, float]]]:
        """Each series' points of all trainers merged, oldest first: {"loss": [(ts, loss), ...], "eval_loss": [...]}."""
        curves: dict[str, list[tuple[float, float]]] = {series: [] for series in SERIES}
        with self._lock:
            for series, ts, value in self._db.execute("SELECT series, ts, value FROM learning ORDER BY ts, trainer"):
                curves[series].append((ts, value))
        return curves

    def withheld_reasons(self) -> dict[str, str]:
        """Peer id -> why its compute points are withheld."""
        with self._lock:
            return dict(self._db.execute("SELECT peer_id, reason FROM withheld"))

    def history(self, identity: str) -> list[HistoryPoint]:
        """The identity's points over time, oldest first (the newest figures of each bucket of time)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT ts, presence, compute FROM history WHERE identity = ? ORDER BY bucket", (identity,)
            ).fetchall()
        return [HistoryPoint(*row) for row in rows]

    def set_summary(self, summary: SwarmSummary) -> None:
        self._summary = summary

    def summary(self) -> SwarmSummary | None:
        """The latest scrape's view of the swarm; None before the first scrape of this process."""
        return self._summary

    def leaderboard(self, now: float) -> list[LeaderboardRow]:
        return leaderboard(self.peers().values(), now, self.policy)

    def _load(self) -> dict[str, PeerState]:
        peers = {}
        for row in self._db.execute(_LOAD):
            peers[row[0]] = PeerState(
                peer_id=row[0],
                identity=row[1],
                stage=row[2],
                first_seen=row[3],
                last_seen=row[4],
                sync_phase=row[5],
                run_id=row[6],
                last_active_seconds=row[7],
                last_compute_flops=row[8],
                presence_seconds=row[9],
                compute_flops=row[10],
                last_published_at=row[11],
                withheld=bool(row[12]),
                receipted_flops=row[13],
                unpaid_flops=row[14],
            )
        return peers

    def _write_history(self, peers: Iterable[PeerState], identities: set[str], now: float) -> None:
        totals = identity_totals((peer for peer in peers if peer.identity in identities), now)
        self._db.executemany(
            "INSERT OR REPLACE INTO history (identity, bucket, ts, presence, compute) VALUES (?, ?, ?, ?, ?)",
            [(identity, bucket_of(now), now, point.presence, point.compute) for identity, point in totals.items()],
        )
        self._db.executemany(
            "DELETE FROM history WHERE identity = ? AND bucket < ?",
            [(identity, oldest_bucket_kept(now)) for identity in totals],
        )

    def _write(self, peer: PeerState, record_json: str) -> None:
        db = self._db
        db.execute(
            "INSERT INTO identities (identity, joined) VALUES (?, ?) "
            "ON CONFLICT(identity) DO UPDATE SET joined = MIN(joined, excluded.joined)",
            (peer.identity, peer.first_seen),
        )
        db.execute(
            "INSERT INTO peers (peer_id, identity, stage, first_seen, last_seen, sync_phase) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(peer_id) DO UPDATE SET stage = excluded.stage, last_seen = excluded.last_seen, "
            "sync_phase = excluded.sync_phase",
            (peer.peer_id, peer.identity, peer.stage, peer.first_seen, peer.last_seen, peer.sync_phase),
        )
        db.execute(
            "INSERT OR REPLACE INTO observations (peer_id, run_id, published_at, "
            "active_seconds, compute_flops, record_json) VALUES (?, ?, ?, ?, ?, ?)",
            (
                peer.peer_id,
                peer.run_id,
                peer.last_published_at,
                peer.last_active_seconds,
                peer.last_compute_flops,
                record_json,
            ),
        )
        db.execute(
            "INSERT OR REPLACE INTO totals (peer_id, presence_seconds, compute_flops) VALUES (?, ?, ?)",
            (peer.peer_id, peer.presence_seconds, peer.compute_flops),
        )


def _migrate_receipts(db: sqlite3.Connection) -> None:
    """A ledger from before escrow: every receipted FLOP was payable."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(receipts)")}
    if columns and "payable" not in columns:
        db.execute("ALTER TABLE receipts ADD COLUMN payable REAL NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE receipts ADD COLUMN held REAL NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE receipts ADD COLUMN forfeited REAL NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE receipts ADD COLUMN disputed INTEGER NOT NULL DEFAULT 0")
        db.execute("UPDATE receipts SET payable = flops")


def _migrate(db: sqlite3.Connection) -> None:
    """A ledger from before presence was observed: its per-run presence budget gives way to the record's timestamp
    (0: the next record is fresh)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(observations)")}
    if "run_first_seen" in columns:
        db.execute("ALTER TABLE observations DROP COLUMN run_first_seen")
        db.execute("ALTER TABLE observations DROP COLUMN run_presence_seconds")
        db.execute("ALTER TABLE observations ADD COLUMN published_at REAL NOT NULL DEFAULT 0")
