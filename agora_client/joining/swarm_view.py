"""Each stage of the swarm as a contributor can see it, for the app's swarm view (SwarmEvent.stages).

Four public sources: the DHT roster (workers by sync phase and health), the auth service's /v1/status
(join queue and capacity per stage), the trainers' progress records (their spot checks per stage) and the workers'
signed metrics records, verified as the monitor verifies them (the stage's replica drift).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from hivemind import DHT

from agora_client.auth.client import swarm_status
from agora_client.discovery.progress_records import StageSpotChecks, TrainerProgress
from agora_client.discovery.roster import WorkerRecord, fetch_roster
from agora_client.events import SpotCheckStatus, StageSwarm
from agora_client.monitor.records import fetch_replica_drifts

STATUS_EVERY = 30.0  # the auth service is asked this often (every contributor asks it)
STATUS_TIMEOUT_S = 3.0  # the worker's report loop waits at most this long for it
# As the monitor's page says it: a kind of request is judged if any trainer judges it (unverifiable beats calibrating:
# it will not change by waiting); the stage stands where its less assured kind stands.
_BY_TRAINERS = ("verifiable", "unverifiable", "calibrating")
_BY_KINDS = ("unverifiable", "calibrating", "verifiable")


def spot_check_status(reports: Iterable[StageSpotChecks]) -> SpotCheckStatus | None:
    """The trainers' reports on one stage as one: counts summed, and the standing (see _BY_TRAINERS)."""
    reports = list(reports)
    if not reports:
        return None
    forward = min((report.forward.state for report in reports), key=_BY_TRAINERS.index)
    backward = min((report.backward.state for report in reports), key=_BY_TRAINERS.index)
    return SpotCheckStatus(
        checks=sum(report.checks for report in reports),
        strikes=sum(report.strikes for report in reports),
        bans=sum(report.bans for report in reports),
        state=min((forward, backward), key=_BY_KINDS.index),
    )


def stage_view(
    stage: str,
    roster: Iterable[WorkerRecord],
    status: dict[str, Any] | None,
    records: list[TrainerProgress],
    drift: float | None,
) -> StageSwarm:
    """One stage: workers by phase from its roster, queue and capacity from /v1/status's ``stages`` entry for it,
    the trainers' spot checks of it from their ``records`` and its replica ``drift``."""
    workers = list(roster)
    present = [worker for worker in workers if worker.healthy and not worker.yielding]
    entry = (status or {}).get(stage) or {}
    return StageSwarm(
        stage=stage,
        active=sum(1 for worker in present if worker.sync_phase == 0),
        syncing=sum(1 for worker in present if worker.sync_phase != 0),
        unhealthy=sum(1 for worker in workers if not worker.healthy),
        yielding=sum(1 for worker in workers if worker.healthy and worker.yielding),
        queued=entry.get("queued"),
        capacity=entry.get("capacity"),
        spot_checks=spot_check_status(record.spot_checks[stage] for record in records if stage in record.spot_checks),
        drift=drift,
    )


class StageWatch:
    """Reads the stages' view; the auth service's status only every STATUS_EVERY seconds (the last answer is kept)."""

    def __init__(self, swarm_url: str, stages: Iterable[str]) -> None:
        self.swarm_url, self.stages = swarm_url, tuple(stages)
        self.status: dict[str, Any] | None = None
        self._asked_at: float | None = None

    def _status(self) -> dict[str, Any] | None:
        now = time.monotonic()
        if self._asked_at is None or now - self._asked_at >= STATUS_EVERY:
            self._asked_at = now
            try:
                self.status = swarm_status(self.swarm_url, timeout_s=STATUS_TIMEOUT_S).get("stages")
            except (
                Exception
            ):  # unreachable, or a bad answer (the client raises a private error for it): shown as unknown
                self.status = None
        return self.status

    def read(self, dht: DHT, records: list[TrainerProgress], auth_public_key: str | None) -> list[StageSwarm]:
        """Every stage's view; without the auth service's key (an open worker) no metrics record can be verified,
        so no stage has a drift figure."""
        status = self._status()
        drifts = fetch_replica_drifts(dht, self.stages, auth_public_key) if auth_public_key else {}
        return [
            stage_view(stage, fetch_roster(dht, stage).values(), status, records, drifts.get(stage))
            for stage in self.stages
        ]
