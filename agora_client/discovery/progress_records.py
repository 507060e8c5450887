"""The trainers' progress records in the DHT: the key, the schema and the read.

Each trainer stores ``TrainerProgress`` at key ``agora.trainers`` under its peer id as subkey (see
agora_client.trainer.progress, which writes them). Contributors and the monitor read the whole key.
The records are unsigned: they say how the swarm is learning, nothing is credited from them.
"""

from __future__ import annotations

from typing import Literal

from hivemind import DHT
from hivemind.utils import ValueWithExpiration
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PROGRESS_KEY = "agora.trainers"
HISTORY_POINTS = 120

Point = tuple[float, float]  # (wall time, loss)


class CheckStanding(BaseModel):
    """Whether a trainer's spot checks judge one stage's requests of one kind (agora_client/trainer/calibration.py)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    state: Literal["calibrating", "verifiable", "unverifiable"]
    tolerance: float | None = None  # the calibrated tolerance; None while calibrating
    samples: int = Field(ge=0)  # honest distances it was calibrated from


class StageSpotChecks(BaseModel):
    """A trainer's spot checks on one stage: how many, what they cost its workers, and where they stand."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    checks: int = Field(ge=0)
    strikes: int = Field(ge=0)
    bans: int = Field(ge=0)
    forward: CheckStanding
    backward: CheckStanding


class TrainerProgress(BaseModel):
    """One trainer's newest figures and its recent curves. Records written before held-out evaluation
    existed have no eval fields: they parse with ``eval_loss`` None and an empty ``eval_history``."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    peer_id: str
    microbatches: int = Field(ge=0)
    loss: float | None = None  # mean loss since the previous report; None if no microbatch finished
    tokens_per_s: float = Field(ge=0, default=0.0)
    history: list[Point] = Field(default_factory=list, max_length=HISTORY_POINTS)
    eval_loss: float | None = None  # the newest held-out evaluation's loss; None before the first one
    eval_history: list[Point] = Field(default_factory=list, max_length=HISTORY_POINTS)  # (time of the eval, its loss)
    spot_checks: dict[str, StageSpotChecks] = Field(default_factory=dict)  # per stage; empty without spot checks
    ts: float


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
