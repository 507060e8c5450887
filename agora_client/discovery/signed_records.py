"""The DHT keys and record schemas of what workers and trainers sign: metrics, verdicts and receipts.

A worker stores its ``MetricsRecord`` under ``agora.metrics.<stage>``, a trainer its ``Verdict`` under
``agora.verdicts`` and its ``Receipt`` under ``agora.receipts``, each under an owner subkey only its key can
write. The record validators every node runs check these schemas; the monitor (agora_client.monitor) checks
signer, ticket and claims.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agora_client.events import SyncPhase

METRICS_KEY_PREFIX = "agora.metrics."
VERDICTS_KEY = "agora.verdicts"
RECEIPTS_KEY = "agora.receipts"
MAX_RECEIPT_WORKERS = 4096  # workers one trainer's receipt may name: bounds what a node stores for it


class MetricsRecord(BaseModel):
    """What a worker publishes about itself. Counters are monotonic within one ``run_id``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = 1
    peer_id: str
    identity: str
    ticket: str
    stage: str
    run_id: str = Field(description="random per worker process; a new one tells the monitor its counters restarted")
    sync_phase: SyncPhase
    flops_total: float = Field(ge=0, description="FLOPs processed in every phase")
    compute_flops: float = Field(ge=0, description="FLOPs processed from sync phase 2 on: the ones that earn points")
    active_seconds: float = Field(ge=0, description="seconds registered and visible, from sync phase 1 on")
    busy_seconds: float = Field(ge=0, description="seconds spent inside forward / backward")
    batches: int = Field(ge=0, description="backward requests processed (each one a microbatch)")
    forwards: int = Field(ge=0, description="forward requests processed")
    tokens: int = Field(ge=0, description="tokens processed in backward requests")
    sparta_rounds: int = Field(default=0, ge=0)
    sparta_success_rate: float = Field(default=0.0, ge=0, le=1)
    sparta_last_fraction: float = Field(default=0.0, ge=0, le=1)
    sparta_drift_before: float | None = Field(
        default=None,
        ge=0,
        description="the latest round that averaged: relative L2 of this worker's slice from its "
        "group's average before the update (agora_client/averaging/drift.py); None: no round has averaged yet",
    )
    sparta_drift_after: float | None = Field(default=None, ge=0, description="the same, right after the update")
    ts: float


def metrics_key(stage: str) -> str:
    return f"{METRICS_KEY_PREFIX}{stage}"


class Verdict(BaseModel):
    """A trainer's finding: this worker's outputs disagreed with its stage's majority this often."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = 1
    trainer: str = Field(description="peer id of the trainer's RSA key, which signs the record")
    ticket: str = Field(description="the trainer's ticket (role trainer)")
    peer_id: str = Field(description="the worker caught")
    uid: str
    stage: str
    checks: int = Field(ge=1, description="spot checks the worker took part in")
    disagreements: int = Field(ge=1, description="checks where it disagreed with the majority")
    ts: float

    @property
    def subkey_name(self) -> str:
        return f"{self.peer_id}/{self.trainer}"


class ServedCounts(BaseModel):
    """What one worker served one trainer: requests and the FLOPs they cost (the worker's own formula)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: str
    forwards: int = Field(ge=0)
    backwards: int = Field(ge=0)
    flops: float = Field(ge=0, description="every request served, held or not")
    held_flops: float = Field(default=0, ge=0, description="in escrow now: a stage spot checks could not judge yet")
    forfeited_flops: float = Field(default=0, ge=0, description="never paid: caught, disputed or expired in escrow")
    disputed_windows: int = Field(default=0, ge=0, description="escrow windows whose checks blamed nobody")

    @property
    def payable_flops(self) -> float:
        """What the monitor may credit: served, less what escrow holds or forfeited."""
        return max(0.0, self.flops - self.held_flops - self.forfeited_flops)


class Receipt(BaseModel):
    """A trainer's account of the work each worker served it. Counters are monotonic within one ``run_id``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = 1
    trainer: str = Field(description="peer id of the trainer's RSA key, which signs the record")
    ticket: str = Field(description="the trainer's ticket (role trainer)")
    run_id: str = Field(description="random per trainer process; a new one starts its counters from zero")
    served: dict[str, ServedCounts] = Field(max_length=MAX_RECEIPT_WORKERS, description="worker peer id -> its counts")
    ts: float

    @property
    def subkey_name(self) -> str:
        return self.trainer
