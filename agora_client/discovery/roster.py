"""Worker announcements in the DHT: one record per worker under its stage's key.

A worker stores ``WorkerRecord`` at key ``agora.roster.<stage>`` with its peer id as subkey (so two
workers can never hide each other, even if they picked the same uid); trainers and same-stage peers
read the whole key to get the stage's live roster.
"""

from __future__ import annotations

from typing import Literal

from hivemind import DHT
from hivemind.utils import ValueWithExpiration, get_dht_time
from pydantic import BaseModel, ConfigDict, ValidationError

# 0 = off (active), 1 = weights sync (invisible to trainers), 2 = optimizer sync
SyncPhaseCode = Literal[0, 1, 2]


class WorkerRecord(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    uid: str
    peer_id: str
    stage: str
    sync_phase: SyncPhaseCode = 0
    epoch: int = 0
    healthy: bool = True  # False: its own outputs turned non-finite; it serves nothing until it has reloaded
    yielding: bool = False  # True: it gave the GPU back to its owner for now (it keeps its slot, serves nothing)

    @property
    def key(self) -> tuple[str, str]:
        """(uid, peer id): a worker restarted under the same uid with a new peer id is a new worker."""
        return (self.uid, self.peer_id)

    @property
    def routable(self) -> bool:
        """Trainers send batches to healthy workers that are active or warming up their optimizer (phase 2), unless
        they yield the GPU to its owner."""
        return self.healthy and not self.yielding and self.sync_phase != 1


def averaging_workers(roster: dict[str, WorkerRecord]) -> int:
    """How many of the stage's workers take part in its SPARTA rounds: all but those yielding the GPU (a syncing one
    averages too, receive-only). Not the progress tracker's peer count: a worker reports progress only in an epoch
    it got samples in, so a slow or syncing one would be left out and groups would close without it."""
    return sum(not record.yielding for record in roster.values())


def roster_key(stage: str) -> str:
    return f"agora.roster.{stage}"


def progress_prefix(stage: str) -> str:
    """The stage's ProgressTracker prefix (its DHT key is ``<prefix>_progress``)."""
    return f"agora.progress.{stage}"


def stage_uid(stage: str, index: int) -> str:
    return f"{stage}.0.{index}"


def announce(dht: DHT, record: WorkerRecord, ttl: float) -> bool:
    return bool(dht.store(roster_key(record.stage), record.model_dump(), get_dht_time() + ttl, subkey=record.peer_id))


def withdraw(dht: DHT, record: WorkerRecord, ttl: float) -> None:
    """Overwrite this worker's record with None so peers drop it before it would expire."""
    dht.store(roster_key(record.stage), None, get_dht_time() + ttl, subkey=record.peer_id)


def fetch_roster(dht: DHT, stage: str) -> dict[str, WorkerRecord]:
    """The stage's live workers by peer id; malformed or withdrawn entries are skipped."""
    found = dht.get(roster_key(stage), latest=True)
    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        return {}
    roster: dict[str, WorkerRecord] = {}
    for peer_id, entry in found.value.items():
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if not isinstance(value, dict):
            continue
        try:
            record = WorkerRecord.model_validate(value)
        except ValidationError:
            continue
        if record.peer_id == peer_id and record.stage == stage:
            roster[peer_id] = record
    return roster


def free_index(roster: dict[str, WorkerRecord], stage: str) -> int:
    taken = {record.uid for record in roster.values()}
    index = 0
    while stage_uid(stage, index) in taken:
        index += 1
    return index
