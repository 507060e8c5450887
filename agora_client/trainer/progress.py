"""Trainers' progress records in the DHT: how the swarm is learning, for every contributor to see.

Each trainer stores ``TrainerProgress`` (agora_client.discovery.progress_records, where the monitor
reads it too) at every progress report: its newest mean loss, throughput, its newest held-out eval
loss, and short histories of both so a client that just joined can draw the curves at once; with spot
checks on, per stage, how many it made, the strikes and bans they gave, and whether each stage is
calibrating, verifiable (with its tolerance) or unverifiable.
"""

from __future__ import annotations

import time
from collections import deque

from hivemind import DHT
from hivemind.utils import get_dht_time

from agora_client.discovery.progress_records import (
    HISTORY_POINTS,
    PROGRESS_KEY,
    Point,
    StageSpotChecks,
    TrainerProgress,
    fetch_progress,
)
from agora_client.events import SwarmEvent

__all__ = ["ProgressPublisher", "TrainerProgress", "fetch_progress", "swarm_event"]


class ProgressPublisher:
    """Keeps a trainer's loss and eval-loss histories and stores its record at every report."""

    def __init__(self, dht: DHT, ttl: float) -> None:
        self.dht, self.ttl = dht, ttl
        self.peer_id = dht.peer_id.to_base58()
        self.history: deque[Point] = deque(maxlen=HISTORY_POINTS)
        self.eval_history: deque[Point] = deque(maxlen=HISTORY_POINTS)

    def publish(
        self,
        microbatches: int,
        loss: float | None,
        tokens_per_s: float,
        eval_loss: float | None = None,
        eval_at: float | None = None,
        spot_checks: dict[str, StageSpotChecks] | None = None,
    ) -> bool:
        """Store this report. ``eval_loss`` is the newest held-out evaluation's loss and ``eval_at`` the wall
        time (``time.time()``) that evaluation finished: pass both at every report until the next evaluation;
        the point (eval_at, eval_loss) joins the eval history once, the first time that ``eval_at`` is seen.
        ``spot_checks``: per stage, this trainer's spot checks and whether they can judge it (SpotChecker.report)."""
        if (eval_loss is None) != (eval_at is None):
            raise ValueError(
                "ProgressPublisher.publish takes eval_loss and eval_at together (the evaluation's loss "
                "and the wall time it finished), or neither before the first evaluation"
            )
        now = time.time()
        if loss is not None:
            self.history.append((now, loss))
        if eval_at is not None and (not self.eval_history or eval_at > self.eval_history[-1][0]):
            self.eval_history.append((eval_at, eval_loss))
        record = TrainerProgress(
            peer_id=self.peer_id,
            microbatches=microbatches,
            loss=loss,
            tokens_per_s=tokens_per_s,
            history=list(self.history),
            eval_loss=eval_loss,
            eval_history=list(self.eval_history),
            spot_checks=spot_checks or {},
            ts=now,
        )
        return bool(self.dht.store(PROGRESS_KEY, record.model_dump(), get_dht_time() + self.ttl, subkey=self.peer_id))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _merged(histories: list[list[Point]]) -> list[Point]:
    """The trainers' histories as one curve, ordered by time, the newest HISTORY_POINTS kept."""
    return sorted(point for history in histories for point in history)[-HISTORY_POINTS:]


def swarm_event(records: list[TrainerProgress]) -> SwarmEvent:
    """The swarm's loss and eval loss now (means over the trainers that have one) and over time (merged)."""
    return SwarmEvent(
        trainers=len(records),
        loss=_mean([record.loss for record in records if record.loss is not None]),
        loss_history=_merged([record.history for record in records]),
        eval_loss=_mean([record.eval_loss for record in records if record.eval_loss is not None]),
        eval_history=_merged([record.eval_history for record in records]),
        tokens_per_s=round(sum(record.tokens_per_s for record in records), 1),
    )
