"""The swarm's learning curve as the monitor keeps it: one point per trainer, series and time.

The trainers' progress records carry their recent loss and held-out eval-loss histories; every
scrape turns them into points. A point is identified by (trainer, series, ts), so the same point read
again (the next scrape, or a trainer repeating its newest evaluation) is stored once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from agora_client.discovery.progress_records import TrainerProgress

Series = Literal["loss", "eval_loss"]
SERIES: tuple[Series, ...] = ("loss", "eval_loss")


@dataclass(frozen=True)
class LearningPoint:
    trainer: str  # the trainer's peer id
    series: Series
    ts: float
    value: float


def learning_points(records: Iterable[TrainerProgress]) -> list[LearningPoint]:
    """Every point of the records' histories; NaN and infinite losses (a diverged trainer) are left out."""
    points = []
    for record in records:
        for series, history in (("loss", record.history), ("eval_loss", record.eval_history)):
            points.extend(
                LearningPoint(record.peer_id, series, ts, value)
                for ts, value in history
                if math.isfinite(ts) and math.isfinite(value)
            )
    return points
