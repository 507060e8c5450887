"""The join state machine after the download: sync phase 1 (weights), phase 2 (optimizer), active.

Phase lengths count stage epochs. A worker that falls more than ``max_allowed_stale`` epochs
behind its stage starts again at phase 1.

Phase 1 exists to bring weights that trail the stage to its current ones, and only averaging rounds do that:
a worker in phase 1 takes no optimizer step, so its weights fall one more epoch behind with every stage epoch
in which no round reaches their slice. With ``skip_phase1_when_fresh``, weights that trail the stage by no
more than ``max_allowed_stale`` epochs when phase 1 begins (a fresh snapshot) pass it at once: the stage lets
an active worker trail that far before it re-syncs, and waiting would only make them staler. Phase 2 (the
optimizer's warm-up, receive-only averaging) is the same for every worker.
"""

from __future__ import annotations

import threading
from typing import Callable

from agora_client.config import SyncConfig
from agora_client.events import SyncEvent

PHASE1_MESSAGE = "Synchronising weights with peers. Node won't process batches in this phase."
PHASE2_MESSAGE = (
    "Synchronising optimizer state. Node is now processing batches, but doesn't contribute to weight averaging yet."
)
ACTIVE_MESSAGE = "Sync complete. Node is now fully contributing to training."
NAMES = {1: "sync1", 2: "sync2", 0: "active"}


def duration_message(steps: int, target_epoch: int) -> str:
    return f"This phase will last {steps} steps (until local epoch {target_epoch})."


def fresh_message(lag: int, max_allowed_stale: int) -> str:
    return (
        f"The weights trail the stage by {lag} epochs (at most {max_allowed_stale}, what an active worker may): "
        "they are in sync already, so this phase ends at once."
    )


class SyncState:
    """Current phase (1, 2 or 0 = active) and the epoch at which it ends; emits a SyncEvent per transition."""

    def __init__(self, config: SyncConfig, emit: Callable[[SyncEvent], None], *, joining: bool):
        self._config, self._emit = config, emit
        self._lock = threading.Lock()
        # A joiner is in phase 1 from the start (never routed to), but its phase-1 clock starts at begin().
        self.phase = 1 if joining else 0
        self.target_epoch: int | None = None if joining else 0

    def begin(self, stage_epoch: int, weights_epoch: int | None = None) -> None:
        """Start counting phase 1 from the stage's current epoch (the joiner is in a stable window).

        ``weights_epoch``: the stage epoch a joiner's weights are from (its snapshot's); None (not known, or a
        re-sync that must run in full) otherwise. Fresh weights pass phase 1 at once where the run says so (the
        module's docstring says why)."""
        with self._lock:
            lag = None if weights_epoch is None else stage_epoch - weights_epoch
            config = self._config
            if config.skip_phase1_when_fresh and lag is not None and lag <= config.max_allowed_stale:
                self._enter(1, stage_epoch, steps=0, why=fresh_message(max(lag, 0), config.max_allowed_stale))
            else:
                self._enter(1, stage_epoch)
            self._advance(stage_epoch)

    @property
    def averaging_weight(self) -> float:
        """Workers in a sync phase receive the average but contribute nothing to it."""
        return 1.0 if self.phase == 0 else 0.0

    @property
    def counts_samples(self) -> bool:
        return self.phase == 0

    def on_epoch(self, local_epoch: int, stage_epoch: int) -> None:
        with self._lock:
            if self.target_epoch is None:
                return
            if stage_epoch - local_epoch > self._config.max_allowed_stale and self.phase != 1:
                self._enter(1, stage_epoch)
                return
            self._advance(local_epoch)

    def _advance(self, local_epoch: int) -> None:
        """Pass every phase that has ended by ``local_epoch`` (caller holds the lock)."""
        while self.phase != 0 and local_epoch >= self.target_epoch:
            self._enter(2 if self.phase == 1 else 0, self.target_epoch)

    def _enter(self, phase: int, epoch: int, *, steps: int | None = None, why: str | None = None) -> None:
        if steps is None:
            steps = {1: self._config.phase1_steps, 2: self._config.phase2_steps, 0: 0}[phase]
        self.phase, self.target_epoch = phase, epoch + steps
        if phase == 0:
            self._emit(SyncEvent(phase="active", local_epoch=epoch, message=ACTIVE_MESSAGE))
            return
        first = PHASE1_MESSAGE if phase == 1 else PHASE2_MESSAGE
        self._emit(
            SyncEvent(
                phase=NAMES[phase],
                steps_left=steps,
                steps_total=steps,
                target_epoch=self.target_epoch,
                local_epoch=epoch,
                message=f"{first}\n{why or duration_message(steps, self.target_epoch)}",
            )
        )
