"""The trainer's records in the checkpoint store, written every ``checkpoint.period_s`` by one background thread:
the data position is taken in the training loop (where it is consistent), only the upload runs beside it."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from agora_client.checkpoints.trainer_records import save_trainer_record
from agora_client.config import RunConfig
from agora_client.data.stream import TokenStream
from agora_client.snapshots import SnapshotError, SnapshotStore


class TrainerRecords:
    def __init__(self, store: SnapshotStore, config: RunConfig, stream: TokenStream, on_failure: Callable[[str], None]):
        self.store, self.config, self.stream, self.on_failure = store, config, stream, on_failure
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="trainer-record")
        self._pending: Future | None = None
        self._last = time.monotonic()

    def save_if_due(self, microbatches: int, eval_loss: float | None) -> None:
        """Called between microbatches with the number handed out: the stream's position is just after them."""
        due = time.monotonic() - self._last >= self.config.checkpoint.period_s
        if not due or (self._pending is not None and not self._pending.done()):
            return  # a write still in flight: this one waits for the next call
        self._last = time.monotonic()
        position = self.stream.position()
        self._pending = self._writer.submit(self._save, microbatches, position, eval_loss)

    def close(self, microbatches: int, eval_loss: float | None) -> None:
        """On a stop: write where the data stands now, and wait for it."""
        self._writer.submit(self._save, microbatches, self.stream.position(), eval_loss)
        self._writer.shutdown(wait=True)

    def _save(self, microbatches: int, position: dict, eval_loss: float | None) -> None:
        try:
            save_trainer_record(
                self.store,
                self.config,
                shard=str(self.stream.shard),
                microbatches=microbatches,
                position=position,
                eval_loss=eval_loss,
            )
        except (SnapshotError, OSError) as error:
            self.on_failure(f"could not save the data position to {self.store.location}: {error}")
