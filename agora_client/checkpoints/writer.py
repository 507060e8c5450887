"""A worker's periodic checkpoints: every ``checkpoint.period_s`` seconds of its run config, at an epoch
boundary, stamped with the wall-clock time; then the store is pruned by the retention policy.

A checkpoint is a stage snapshot (weights, optimizer state with its step counters, the stage epoch)
whose manifest also records the run (seed and model config, to rebuild and check it) and training
statistics: the clipping bound and last gradient norm, and, on the tail, the loss the trainers'
batches had since the previous checkpoint. Writing runs in a background thread; only serialization
holds the stage lock, an upload does not.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
from torch import nn

from agora_client.config import RunConfig
from agora_client.events import EventWriter
from agora_client.snapshots import SnapshotError, SnapshotStore, StoredSnapshot

from .retention import Retention
from .sets import RUN_KEY, TRAINING_KEY, run_record


class CheckpointWriter:
    def __init__(
        self,
        store: SnapshotStore,
        config: RunConfig,
        stage: str,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        lock: threading.RLock,
        *,
        grad_norm: Callable[[], float | None],
        events: EventWriter,
    ):
        self.store, self.config, self.stage = store, config, stage
        self.module, self.optimizer, self.lock = module, optimizer, lock
        self.grad_norm, self.events = grad_norm, events
        self.period_s = config.checkpoint.period_s
        self.retention = Retention.from_config(config.checkpoint)
        self.last_written = time.monotonic()
        self._losses: list[float] = []
        self._last_loss: float | None = None  # the latest mean: a checkpoint with no new losses (the final one) keeps it
        self._thread: threading.Thread | None = None

    def on_epoch(self, epoch: int, loss: float | None, *, averaging: bool) -> None:
        """After every stage epoch: note the loss; start a checkpoint when one is due.

        A due checkpoint waits for an epoch without an averaging round in flight (its upload would compete
        with the round for bandwidth), but never longer than one more period: the state under the lock is
        consistent either way, and a stage with rounds back to back must still be checkpointed.
        """
        if loss is not None:
            self._losses.append(loss)
        elapsed = time.monotonic() - self.last_written
        due = elapsed >= self.period_s and (not averaging or elapsed >= 2 * self.period_s)
        if due and not (self._thread and self._thread.is_alive()):
            self.last_written = time.monotonic()
            self._thread = threading.Thread(target=self._write_logged, args=(epoch,), name=f"checkpoint-{self.stage}", daemon=True)
            self._thread.start()

    def close(self, epoch: int) -> None:
        """On a graceful stop: wait for a write in flight, then write the final state."""
        if self._thread is not None:
            self._thread.join()
        self._write_logged(epoch)

    def write(self, epoch: int) -> StoredSnapshot:
        losses, self._losses = self._losses, []
        if losses:
            self._last_loss = sum(losses) / len(losses)
        training = {
            "loss": self._last_loss,
            "clip_norm": self.config.clip_norm(self.stage),
            "last_grad_norm": self.grad_norm(),
            "period_s": self.period_s,
        }
        extra = {RUN_KEY: run_record(self.config), TRAINING_KEY: training}
        written = self.store.save(self.stage, self.module, self.optimizer, epoch, extra=extra, lock=self.lock)
        removed = self.store.prune(self.stage, self.retention)
        self.events.log(f"checkpoint {written.name} of {self.stage} written to {self.store.location}"
                        + (f"; {len(removed)} older ones pruned" if removed else ""), tag="CHECKPOINT")
        return written

    def _write_logged(self, epoch: int) -> None:
        try:
            self.write(epoch)
        except (SnapshotError, OSError) as error:  # a full disk or an unreachable bucket must not stop training
            self.events.log(f"checkpoint of {self.stage} at epoch {epoch} failed: {error}", tag="CHECKPOINT", level="error")
