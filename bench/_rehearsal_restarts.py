"""Crashes on the operator's side in the rehearsal (bench/rehearsal.py), and what survives them.

`agora deploy up` restarts no role: when one exits it stops the host's other roles and exits itself, so a crashed
role comes back when the operator runs `deploy up` again, with the host's other roles. So the auth service's crash
restarts the whole operator's host (seeds, relay, auth, monitor, snapshot server, its workers), and a trainer's
crash both trainers. Before the crash and after the restart the rehearsal reads the auth service's status (slots
held per stage, queue lengths) and the monitor's leaderboard: slots and queue places kept, no one's points lower.
"""

from __future__ import annotations

import time

import _rehearsal_operator as operator_side
from _rehearsal_net import Internet

SETTLE_S = 10.0  # after the restart: the monitor's first scrape of the DHT
POINTS_SLACK = 1e-6


def _slots(status: dict | None) -> dict | None:
    """Per stage: slots held (active and pending) and queue places."""
    if status is None:
        return None
    stages = status.get("stages", {})
    return {stage: {"held": n["active"] + n["pending"], "queued": n["queued"]} for stage, n in stages.items()}


def _scores(rows: list[dict] | None) -> dict[str, float] | None:
    return None if rows is None else {str(row.get("username")): float(row.get("score", 0.0)) for row in rows}


class Restarts:
    def __init__(self, net: Internet, files: operator_side.OperatorFiles):
        self.net, self.files = net, files
        self.records: list[dict] = []

    def crash_operator(self) -> str:
        """The auth service dies (SIGKILL); the operator runs `deploy up` on its host again."""
        before_slots = _slots(operator_side.auth_status(self.files, self.net.operator))
        before_points = _scores(operator_side.leaderboard(self.files, self.net.operator))
        started = time.monotonic()
        operator_side.crash_role(self.files, "operator", "auth")
        operator_side.start_again(self.files, self.net.operator, "operator")
        back_s = time.monotonic() - started
        after_slots = _slots(operator_side.auth_status(self.files, self.net.operator))
        time.sleep(SETTLE_S)
        after_points = _scores(operator_side.leaderboard(self.files, self.net.operator))
        lost = None
        if before_points is not None and after_points is not None:
            lost = sorted(u for u, s in before_points.items() if after_points.get(u, 0.0) < s - POINTS_SLACK)
        self.records.append(
            {
                "event": "auth crash: the operator's host restarted",
                "back_after_s": round(back_s, 1),
                "slots_kept": None if before_slots is None or after_slots is None else before_slots == after_slots,
                "slots_before": before_slots,
                "slots_after": after_slots,
                "points_lost_by": lost,
            }
        )
        return f"auth killed; the operator's host was up again after {back_s:.0f}s"

    def crash_trainer(self) -> str:
        """Trainer 0 dies (SIGKILL); the operator runs `deploy up` on the trainers' host again."""
        started = time.monotonic()
        operator_side.crash_role(self.files, "trainers", "trainers-trainer0")
        operator_side.start_again(self.files, self.net.trainers, "trainers")
        back_s = time.monotonic() - started
        self.records.append(
            {"event": "trainer 0 crash: the trainers' host restarted", "back_after_s": round(back_s, 1)}
        )
        return f"trainer 0 killed; the trainers' host was up again after {back_s:.0f}s"
