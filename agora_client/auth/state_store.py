"""The auth service's durable state: slots, join queues, stage pacing and peer bindings in SQLite (WAL).

Every decision of the slot book is committed in one transaction before its answer leaves the service, so an
auth service killed at any moment and started again on the same state dir carries on where it stopped: a
worker's ticket still renews on its slot, a queued joiner still polls its place with its queue id. Tickets
themselves need no rows: the signing key is on disk and a ticket is honoured while its slot is held.
Times are wall-clock seconds (``time.time()``), which mean the same to the next process.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from .admission import AdmissionPolicy, BookState, QueueEntry, Slot, SlotBook

log = logging.getLogger(__name__)

STATE_DB = "auth_state.sqlite3"  # its name in the service's state dir
_SCHEMA = """
CREATE TABLE IF NOT EXISTS slots (
    stage TEXT NOT NULL,
    slot INTEGER NOT NULL,
    identity TEXT NOT NULL,
    peer_id TEXT NOT NULL,
    admitted_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    active INTEGER NOT NULL,
    last_seen REAL NOT NULL,
    PRIMARY KEY (stage, slot)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS queue (
    queue_id TEXT PRIMARY KEY,
    stage TEXT NOT NULL,
    place INTEGER NOT NULL,
    identity TEXT NOT NULL,
    peer_id TEXT NOT NULL,
    joined_at REAL NOT NULL,
    last_seen REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pacing (
    stage TEXT PRIMARY KEY,
    last_admission REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS bindings (
    peer_id TEXT PRIMARY KEY,
    identity TEXT NOT NULL
) WITHOUT ROWID;
"""

# table -> (key columns, value columns) of the slot book's rows
_BOOK_TABLES = {
    "slots": (("stage", "slot"), ("identity", "peer_id", "admitted_at", "expires_at", "active", "last_seen")),
    "queue": (("queue_id",), ("stage", "place", "identity", "peer_id", "joined_at", "last_seen")),
    "pacing": (("stage",), ("last_admission",)),
}

Rows = dict[str, dict[tuple, tuple]]


class StateStoreError(ValueError):
    pass


class AuthStateStore:
    """The state database (``auth_state.sqlite3``, mode 0600). Thread-safe: HTTP handlers and the presence
    watcher decide concurrently; the book serialises its decisions and this store its writes."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))  # SQLite gives its -wal and -shm files this mode
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the answer is sent
            self._db.executescript(_SCHEMA)
            self._saved = self._read_book_rows()
        except sqlite3.DatabaseError as error:
            raise StateStoreError(
                f"{self.path} cannot be read as the auth service's state database ({error}); restore it from a "
                "backup (deleting it forgets every slot, queue place and which account owns which peer key)"
            ) from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- the slot book -------------------------------------------------------------------------------

    def load_book(self) -> BookState:
        with self._lock:
            return _book_state(self._saved)

    def save_book(self, state: BookState) -> None:
        """Commit what changed since the last save, in one transaction (nothing when nothing changed)."""
        rows = _book_rows(state)
        with self._lock:
            changed = any(rows[table] != self._saved[table] for table in _BOOK_TABLES)
            if not changed:
                return
            with self._transaction():
                for table, (keys, values) in _BOOK_TABLES.items():
                    _write_changes(self._db, table, keys, values, self._saved[table], rows[table])
            self._saved = rows

    # -- peer bindings -------------------------------------------------------------------------------

    def bind(self, peer_id: str, identity: str) -> str:
        """Bind ``peer_id`` to ``identity`` if it is unbound; return the identity it is bound to."""
        with self._lock:
            row = self._db.execute("SELECT identity FROM bindings WHERE peer_id = ?", (peer_id,)).fetchone()
            if row is not None:
                return row[0]
            with self._transaction():
                self._db.execute("INSERT INTO bindings (peer_id, identity) VALUES (?, ?)", (peer_id, identity))
            return identity

    def owner(self, peer_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT identity FROM bindings WHERE peer_id = ?", (peer_id,)).fetchone()
            return row[0] if row is not None else None

    def import_bindings(self, owners: dict[str, str]) -> int:
        """Add the bindings of peers the database does not bind yet (it wins); returns how many were added."""
        with self._lock, self._transaction():
            before = self._db.total_changes
            self._db.executemany("INSERT OR IGNORE INTO bindings (peer_id, identity) VALUES (?, ?)", owners.items())
            return self._db.total_changes - before

    # -- internals -----------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _read_book_rows(self) -> Rows:
        rows: Rows = {}
        for table, (keys, values) in _BOOK_TABLES.items():
            cursor = self._db.execute(f"SELECT {', '.join(keys + values)} FROM {table}")
            rows[table] = {tuple(row[: len(keys)]): tuple(row[len(keys) :]) for row in cursor}
        return rows


def open_book(store: AuthStateStore, policy: AdmissionPolicy, now: float) -> SlotBook:
    """The slot book as ``store`` last saved it, committing each later decision there.

    Nobody could poll or be seen in the DHT while the service was down, so every restored queue place and slot
    counts as seen at ``now`` (a downtime costs no one a place); tickets keep their expiry, as the tickets say.
    """
    saved = store.load_book()
    gone = sorted({item.stage for item in (*saved.slots, *saved.queue)} - set(policy.stages))
    if gone:
        log.warning("the run has no stage %s any more: its saved slots and queue places are dropped", ", ".join(gone))
    restored = BookState(
        slots=tuple(replace(slot, last_seen=max(slot.last_seen, now)) for slot in saved.slots),
        queue=tuple(replace(entry, last_seen=max(entry.last_seen, now)) for entry in saved.queue),
        last_admissions=saved.last_admissions,
    )
    if saved.slots or saved.queue:
        log.info("restored %d slot(s) and %d queue place(s) from %s", len(saved.slots), len(saved.queue), store.path)
    return SlotBook(policy, restored, record=store.save_book)


def _book_rows(state: BookState) -> Rows:
    places: dict[str, int] = {}
    queue = {}
    for entry in state.queue:
        places[entry.stage] = places.get(entry.stage, 0) + 1
        queue[(entry.queue_id,)] = (
            entry.stage,
            places[entry.stage],
            entry.identity,
            entry.peer_id,
            entry.joined_at,
            entry.last_seen,
        )
    return {
        "slots": {
            (slot.stage, slot.index): (
                slot.identity,
                slot.peer_id,
                slot.admitted_at,
                slot.expires_at,
                int(slot.active),
                slot.last_seen,
            )
            for slot in state.slots
        },
        "queue": queue,
        "pacing": {(stage,): (at,) for stage, at in state.last_admissions.items()},
    }


def _book_state(rows: Rows) -> BookState:
    slots = tuple(
        Slot(identity, peer_id, stage, index, admitted_at, expires_at, bool(active), last_seen)
        for (stage, index), (identity, peer_id, admitted_at, expires_at, active, last_seen) in rows["slots"].items()
    )
    in_order = sorted(rows["queue"].items(), key=lambda item: item[1][:2])  # by stage, then place
    queue = tuple(
        QueueEntry(queue_id, identity, peer_id, stage, joined_at, last_seen)
        for (queue_id,), (stage, _place, identity, peer_id, joined_at, last_seen) in in_order
    )
    return BookState(slots, queue, {stage: at for (stage,), (at,) in rows["pacing"].items()})


def _write_changes(db: sqlite3.Connection, table: str, keys: tuple, values: tuple, old: dict, new: dict) -> None:
    where = " AND ".join(f"{key} = ?" for key in keys)
    db.executemany(f"DELETE FROM {table} WHERE {where}", [key for key in old if key not in new])
    columns = keys + values
    db.executemany(
        f"INSERT OR REPLACE INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
        [key + row for key, row in new.items() if old.get(key) != row],
    )
