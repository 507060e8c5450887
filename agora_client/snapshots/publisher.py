"""A worker's published stage snapshots (what joiners download): written in the background, the newest few kept.

One publication at a time: one that falls due while the previous one (or a checkpoint) is still being
written is skipped, and a run of skips is said once. A failed write leaves the store as it was (the
store writes into a staging directory that becomes the snapshot only once complete) and is reported.
"""

from __future__ import annotations

import time

from agora_client.events import ErrorEvent, EventWriter

from .background import BackgroundWriter
from .format import StageState
from .store import SnapshotStore, keep_newest


class SnapshotPublisher:
    def __init__(self, store: SnapshotStore, stage: str, writer: BackgroundWriter, keep: int, events: EventWriter):
        self.store, self.stage, self.writer, self.events = store, stage, writer, events
        self.keep = keep_newest(keep)
        self._skipping = False  # a run of skipped publications has been said

    def publish(self, epoch: int) -> bool:
        """Start writing the snapshot of ``epoch``; False when skipped (a write is still in flight)."""
        started = self.writer.submit(
            f"{self.stage} snapshot of epoch {epoch}", lambda state: self._write(state, epoch), self._failed
        )
        if not started and not self._skipping:
            self.events.log(
                f"skipped the {self.stage} snapshot of epoch {epoch}: the previous snapshot or checkpoint is "
                "still being written (said once until a snapshot starts again)",
                tag="SNAPSHOT",
                level="warning",
            )
        self._skipping = not started
        return started

    def _write(self, state: StageState, epoch: int) -> None:
        started = time.monotonic()
        written = self.store.save_state(self.stage, state, epoch)
        self.store.prune(self.stage, self.keep)
        self.events.log(
            f"published the {self.stage} snapshot {written.name} to {self.store.location}: copied in "
            f"{self.writer.last_lock_hold_s:.3f} s (steps wait for the copy, requests do not), written in "
            f"{time.monotonic() - started:.1f} s",
            tag="SNAPSHOT",
        )

    def _failed(self, what: str, error: Exception) -> None:
        message = f"writing the {what} to {self.store.location} failed ({type(error).__name__}: {error})"
        self.events.log(f"{message}; the previous snapshot is kept", tag="SNAPSHOT", level="error")
        self.events.emit(
            ErrorEvent(
                message=message,
                hint="joiners get the previous snapshot meanwhile; free disk space or check the store, the next "
                "one is retried",
                where="snapshot publication",
            )
        )
