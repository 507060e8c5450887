"""Crashes on the operator's side in the rehearsal (bench/rehearsal.py), and what survives them.

Each crash is a SIGKILL to one role's process group; the host's `agora deploy up` starts that role again alone, as
its systemd unit would (agora_client/deploy/supervisor.py), while the host's other roles keep running. Around the
auth service's crash the rehearsal reads its status (the peers holding each stage's slots), its state database
read-only (queue places, peer bindings) and the monitor's leaderboard: the same peers hold the same stages, every
queued peer still queued (no further back) or admitted, every binding kept, no honest user's points lower (a liar's
go once it is caught). Around the monitor's crash, the leaderboard: no honest user's points lower. The relay's and a
trainer's crashes say how long the role was away.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import _rehearsal_operator as operator_side
from _rehearsal_net import Internet

SETTLE_S = 10.0  # after a restart: the monitor's first scrape of the DHT
POINTS_SLACK = 1e-6


def _holders(status: dict | None) -> dict[str, list[str]] | None:
    """The peers holding each stage's slots, as the service says."""
    return None if status is None else status.get("holders")


def _committed(path: Path) -> dict | None:
    """The service's queue places and peer bindings, from its state database (read-only); None if unreadable."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            return {
                "queue": {peer: place for peer, place in db.execute("SELECT peer_id, place FROM queue")},
                "bindings": dict(db.execute("SELECT peer_id, identity FROM bindings")),
            }
        finally:
            db.close()
    except sqlite3.Error:
        return None


def _queue_kept(before: dict | None, after: dict | None, holders: dict[str, list[str]] | None) -> bool | None:
    """Every peer queued before the crash is queued after it at the same place or better, or holds a slot."""
    if before is None or after is None or holders is None:
        return None
    admitted = {peer for peers in holders.values() for peer in peers}
    return all(
        peer in admitted or after["queue"].get(peer, place + 1) <= place for peer, place in before["queue"].items()
    )


def _scores(rows: list[dict] | None) -> dict[str, float] | None:
    return None if rows is None else {str(row.get("username")): float(row.get("score", 0.0)) for row in rows}


def _points_lost_by(
    before: dict[str, float] | None, after: dict[str, float] | None, liars: set[str]
) -> list[str] | None:
    """The honest users whose points fell; a liar's go by design once it is caught, which may be inside the window."""
    if before is None or after is None:
        return None
    return sorted(
        user for user, score in before.items() if user not in liars and after.get(user, 0.0) < score - POINTS_SLACK
    )


class Restarts:
    def __init__(self, net: Internet, files: operator_side.OperatorFiles, liars: set[str]):
        self.net, self.files, self.liars = net, files, liars
        self.records: list[dict] = []

    def _crash(self, host_name: str, role: str) -> float:
        """Seconds from the SIGKILL until `deploy up` had the role ready again."""
        started = time.monotonic()
        operator_side.crash_role(self.files, host_name, role)
        return time.monotonic() - started

    def _leaderboard(self) -> dict[str, float] | None:
        return _scores(operator_side.leaderboard(self.files, self.net.operator))

    def crash_auth(self) -> str:
        before_holders = _holders(operator_side.auth_status(self.files, self.net.operator))
        before_state = _committed(self.files.auth_state)
        before_points = self._leaderboard()
        back_s = self._crash("operator", "auth")
        after_holders = _holders(operator_side.auth_status(self.files, self.net.operator))
        after_state = _committed(self.files.auth_state)
        time.sleep(SETTLE_S)
        self.records.append(
            {
                "event": "auth crash",
                "back_after_s": round(back_s, 1),
                "slots_kept": None
                if before_holders is None or after_holders is None
                else before_holders == after_holders,
                "slots_held": None if before_holders is None else sum(map(len, before_holders.values())),
                "queued_at_crash": None if before_state is None else len(before_state["queue"]),
                "queue_places_kept": _queue_kept(before_state, after_state, after_holders),
                "bindings_kept": None
                if before_state is None or after_state is None
                else before_state["bindings"].items() <= after_state["bindings"].items(),
                "bindings": None if before_state is None else len(before_state["bindings"]),
                "points_lost_by": _points_lost_by(before_points, self._leaderboard(), self.liars),
            }
        )
        return f"auth killed; deploy up had it ready again after {back_s:.0f}s"

    def crash_monitor(self) -> str:
        before_points = self._leaderboard()
        back_s = self._crash("operator", "monitor")
        time.sleep(SETTLE_S)
        lost = _points_lost_by(before_points, self._leaderboard(), self.liars)
        self.records.append({"event": "monitor crash", "back_after_s": round(back_s, 1), "points_lost_by": lost})
        return f"monitor killed; deploy up had it ready again after {back_s:.0f}s"

    def crash_relay(self) -> str:
        back_s = self._crash("operator", "relay")
        self.records.append({"event": "relay crash", "back_after_s": round(back_s, 1)})
        return f"relay killed; deploy up had it ready again after {back_s:.0f}s"

    def crash_trainer(self) -> str:
        back_s = self._crash("trainers", "trainers-trainer0")
        self.records.append({"event": "trainer 0 crash", "back_after_s": round(back_s, 1)})
        return f"trainer 0 killed; deploy up had it ready again after {back_s:.0f}s"

    def events(self) -> dict:
        """The script's operator events (bench/_rehearsal_script.py's OPERATOR_EVENTS) and what plays each."""
        return {
            "auth-crash": self.crash_auth,
            "monitor-crash": self.crash_monitor,
            "relay-crash": self.crash_relay,
            "trainer-crash": self.crash_trainer,
        }
