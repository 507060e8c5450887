"""Trainers' progress records in the DHT: how the swarm is learning, for every contributor to see.

Each trainer stores ``TrainerProgress`` at key ``agora.trainers`` under its peer id as subkey,
at every progress report: its newest mean loss, throughput, and a short history of losses so a
client that just joined can draw the curve at once. Clients read the whole key.
"""

from __future__ import annotations

import time
from collections import deque

from hivemind import DHT
from hivemind.utils import ValueWithExpiration, get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agora_client.events import SwarmEvent

PROGRESS_KEY = "agora.trainers"
HISTORY_POINTS = 120


class TrainerProgress(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    peer_id: str
    microbatches: int = Field(ge=0)
    loss: float | None = None  # mean loss since the previous report; None if no microbatch finished
    tokens_per_s: float = Field(ge=0, default=0.0)
    history: list[tuple[float, float]] = Field(default_factory=list, max_length=HISTORY_POINTS)  # (wall time, loss)
    ts: float


class ProgressPublisher:
    """Keeps a trainer's loss history and stores its record at every report."""

    def __init__(self, dht: DHT, ttl: float) -> None:
        self.dht, self.ttl = dht, ttl
        self.peer_id = dht.peer_id.to_base58()
        self.history: deque[tuple[float, float]] = deque(maxlen=HISTORY_POINTS)

    def publish(self, microbatches: int, loss: float | None, tokens_per_s: float) -> bool:
        now = time.time()
        if loss is not None:
            self.history.append((now, loss))
        record = TrainerProgress(
            peer_id=self.peer_id, microbatches=microbatches, loss=loss, tokens_per_s=tokens_per_s,
            history=list(self.history), ts=now,
        )
        return bool(self.dht.store(PROGRESS_KEY, record.model_dump(), get_dht_time() + self.ttl, subkey=self.peer_id))


def fetch_progress(dht: DHT) -> list[TrainerProgress]:
    """Every live trainer's record; malformed entries are skipped."""
    found = dht.get(PROGRESS_KEY, latest=True)
    if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
        return []
    records = []
    for peer_id, entry in found.value.items():
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        try:
            record = TrainerProgress.model_validate(value)
        except ValidationError:
            continue
        if record.peer_id == peer_id:
            records.append(record)
    return records


def swarm_event(records: list[TrainerProgress]) -> SwarmEvent:
    """The swarm's loss now and over time, from all trainers' records (their histories merged by time)."""
    losses = [record.loss for record in records if record.loss is not None]
    history = sorted(point for record in records for point in record.history)[-HISTORY_POINTS:]
    return SwarmEvent(
        trainers=len(records),
        loss=sum(losses) / len(losses) if losses else None,
        loss_history=history,
        tokens_per_s=round(sum(record.tokens_per_s for record in records), 1),
    )
