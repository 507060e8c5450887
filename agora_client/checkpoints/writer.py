"""A worker's periodic checkpoints: every ``checkpoint.period_s`` seconds of its run config, at an epoch
boundary, stamped with the wall-clock time; then the store is pruned by the retention policy.

A checkpoint is a stage snapshot (weights, optimizer state with its step counters, the stage epoch)
whose manifest also records the run (seed and model config, to rebuild and check it) and training
statistics: the clipping bound and last gradient norm, and, on the tail, the loss the trainers'
batches had since the previous checkpoint. Writing goes through the worker's ``BackgroundWriter``: only
the copy of the state into host memory holds the stage's state lock (steps wait, requests do not);
serialization, hashing and upload hold no lock.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from agora_client.config import RunConfig
from agora_client.events import EventWriter
from agora_client.snapshots import SnapshotStore
from agora_client.snapshots.background import BackgroundWriter
from agora_client.snapshots.format import StageState

from .retention import Retention
from .sets import RUN_KEY, TRAINING_KEY, run_record


class CheckpointWriter:
    def __init__(
        self,
        store: SnapshotStore,
        config: RunConfig,
        stage: str,
        writer: BackgroundWriter,
        *,
        grad_norm: Callable[[], float | None],
        events: EventWriter,
    ):
        self.store, self.config, self.stage, self.writer = store, config, stage, writer
        self.grad_norm, self.events = grad_norm, events
        self.period_s = config.checkpoint.period_s
        self.retention = Retention.from_config(config.checkpoint)
        self.last_written = time.monotonic()
        self._losses: list[float] = []
        self._last_loss: float | None = (
            None  # the latest mean: a checkpoint with no new losses (the final one) keeps it
        )

    def on_epoch(self, epoch: int, loss: float | None, *, averaging: bool) -> None:
        """After every stage epoch: note the loss; start a checkpoint when one is due.

        A due checkpoint waits for an epoch without an averaging round in flight (its upload would compete
        with the round for bandwidth), but never longer than one more period: the state under the lock is
        consistent either way, and a stage with rounds back to back must still be checkpointed. It also waits
        while a snapshot is being written (the two share the host copy of the state).
        """
        if loss is not None:
            self._losses.append(loss)
        elapsed = time.monotonic() - self.last_written
        due = elapsed >= self.period_s and (not averaging or elapsed >= 2 * self.period_s)
        if due and self._submit(epoch):
            self.last_written = time.monotonic()

    def close(self, epoch: int) -> None:
        """On a graceful stop: wait for a write in flight, then write the final state and wait for it."""
        self.writer.wait()
        self._submit(epoch)
        self.writer.wait()

    def _submit(self, epoch: int) -> bool:
        losses, self._losses = self._losses, []
        if losses:
            self._last_loss = sum(losses) / len(losses)
        training = {
            "loss": self._last_loss,
            "clip_norm": self.config.clip_norm(self.stage),
            "last_grad_norm": self.grad_norm(),
            "period_s": self.period_s,
        }
        started = self.writer.submit(
            f"checkpoint of {self.stage} at epoch {epoch}",
            lambda state: self._write(state, epoch, training),
            self._failed,
        )
        if not started:  # the losses count toward the next checkpoint
            self._losses = losses + self._losses
        return started

    def _write(self, state: StageState, epoch: int, training: dict[str, Any]) -> None:
        extra = {RUN_KEY: run_record(self.config), TRAINING_KEY: training}
        written = self.store.save_state(self.stage, state, epoch, extra=extra)
        removed = self.store.prune(self.stage, self.retention)
        self.events.log(
            f"checkpoint {written.name} of {self.stage} written to {self.store.location}"
            + (f"; {len(removed)} older ones pruned" if removed else ""),
            tag="CHECKPOINT",
        )

    def _failed(self, what: str, error: Exception) -> None:
        self.events.log(f"{what} failed: {error}", tag="CHECKPOINT", level="error")
