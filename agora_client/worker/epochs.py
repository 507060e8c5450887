"""Lockstep stage epochs: samples are summed across the stage, then every worker steps its own optimizer.

There is no gradient all-reduce. Each worker accumulates parameter gradients from its own backward
passes; a hivemind ProgressTracker sums the samples of all active workers of the stage in the DHT,
and once the sum crosses ``target_batch_size`` every worker clips and steps locally and the stage
epoch advances. ``lock`` guards parameters and gradients: backward, the optimizer step and the
application of a SPARTA result never overlap (``StageLock``). The step runs in the epoch thread, woken by
the backward that completes the stage's batch, so a step that waits for a host copy of the state holds no
request up.

A step is taken only on finite gradients (a non-finite one is dropped, the weights stay as they were),
and weights that turn non-finite anyway are reported, so the worker leaves routing and reloads.

With optim.share_scaling, a worker's step is scaled by its share of the stage epoch's samples (linear) or that
share's square root (sqrt): every param group's lr is multiplied for that one step and then restored exactly.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, get_args

import torch
from hivemind import DHT
from hivemind.optim.progress_tracker import ProgressTracker

from agora_client.config import OptimConfig
from agora_client.discovery.roster import progress_prefix
from agora_client.worker.sync import SyncState

EPOCH_POLL_SECONDS = 0.25  # a worker that gets no batches still follows the stage's epochs


class StageLock:
    """What guards a stage's weights, gradients and optimizer state.

    Requests (forward, backward) hold ``training``: they read the weights and add to the gradients. Whatever
    changes the weights or the optimizer state (the step, a SPARTA result, a reload) holds the whole lock,
    ``state`` then ``training``, from a thread that holds neither. A host copy of the state for a snapshot or a
    checkpoint holds ``state`` only: the next step waits for it without holding up requests meanwhile.
    """

    def __init__(self) -> None:
        self.training = threading.RLock()
        self.state = threading.Lock()  # not re-entrant: a copy's writer thread releases it for the copy's submitter

    def __enter__(self) -> StageLock:
        self.state.acquire()
        self.training.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.training.release()
        self.state.release()


class EpochController:
    def __init__(
        self,
        dht: DHT,
        stage: str,
        parameters: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        target_batch_size: int,
        clip_norm: float,
        sync: SyncState,
        on_epoch: Callable[[int], None],
        on_error: Callable[[Exception], None],
        on_skipped_step: Callable[[str], None],
        on_corrupt_weights: Callable[[str], None],
        epoch: int = 0,
        share_scaling: str = "none",
    ):
        if share_scaling not in SHARE_SCALINGS:
            raise ValueError(f"share_scaling must be one of {', '.join(SHARE_SCALINGS)}, got {share_scaling!r}")
        self.parameters, self.optimizer, self.clip_norm = parameters, optimizer, clip_norm
        self.share_scaling = share_scaling
        self.sync, self._on_epoch, self._on_error = sync, on_epoch, on_error
        self._on_skipped_step, self._on_corrupt_weights = on_skipped_step, on_corrupt_weights
        self.skipped_steps = 0
        self.lock = StageLock()
        self.epoch = epoch
        self.local_samples = 0  # samples whose gradients sit in .grad now
        self.reported_samples = 0  # of those, the ones this worker counts toward the stage batch
        self.last_grad_norm: float | None = None
        self.last_share: float | None = None  # this worker's share of the samples of the last stage epoch
        self.tracker = ProgressTracker(dht, progress_prefix(stage), target_batch_size, start=True)
        with self.tracker.pause_updates():
            self.tracker.update_epoch(epoch)
        self._stop, self._step_due = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._follow_stage, name=f"epochs-{stage}", daemon=True)

    def start(self) -> None:
        """Follow the stage's epochs in the background (call once the epoch hooks can run)."""
        self._thread.start()

    @property
    def stage_epoch(self) -> int:
        return self.tracker.global_epoch

    def on_samples(self, count: int) -> None:
        """Called after a backward pass added ``count`` samples' gradients (caller holds ``lock.training``)."""
        self.local_samples += count
        if self.sync.counts_samples:
            self.reported_samples += count
        self.tracker.report_local_progress(self.epoch, self.reported_samples)
        if self.tracker.ready_to_update_epoch:  # the epoch thread steps: this one holds only the training lock
            self._step_due.set()

    def maybe_step(self) -> None:
        if not self.tracker.ready_to_update_epoch:
            return
        with self._stepping():
            # samples of the stage's epoch: the reported ones of every peer, plus ours that do not count yet (phase 2)
            stage_samples = (
                self.tracker.global_progress.samples_accumulated - self.reported_samples + self.local_samples
            )
            self.last_share = min(1.0, self.local_samples / stage_samples) if stage_samples > 0 else 0.0
            if self.local_samples:
                self._step()
            self.epoch = self.tracker.update_epoch(max(self.epoch + 1, self.tracker.global_epoch))
            self.local_samples = self.reported_samples = 0
            epoch = self.epoch
        self._on_epoch(epoch)

    @contextmanager
    def _stepping(self) -> Iterator[None]:
        """The whole stage lock and the tracker paused: ``with lock, tracker.pause_updates()``, but the tracker's lock
        comes first. Its fetcher holds that lock through a DHT read, slow under load, which must not hold up requests
        (they take the training lock only). The performance EMA pauses only under the training lock: a request's
        report_local_progress would find it paused (hivemind asserts then)."""
        with self.tracker.lock_global_progress, self.lock, self.tracker.performance_ema.pause():
            yield

    def _step(self) -> None:
        for parameter in self.parameters:  # gradients are sums over samples: make them means
            if parameter.grad is not None:
                parameter.grad.div_(self.local_samples)
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, self.clip_norm))
        if not math.isfinite(self.last_grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self._on_skipped_step(
                f"skipped the optimizer step of epoch {self.epoch}: the gradient norm is {self.last_grad_norm}; "
                "the last good weights are kept"
            )
            return
        # whatever optimizer the node built: only its step() and, to scale a step, its param groups' lr are relied on
        with scaled_lr(self.optimizer, step_scale(self.share_scaling, self.last_share)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not all_finite(self.parameters):
            self._on_corrupt_weights(f"its weights turned non-finite in the optimizer step of epoch {self.epoch}")

    def _follow_stage(self) -> None:
        while not self._stop.is_set():
            self._step_due.wait(EPOCH_POLL_SECONDS)  # a worker that gets no batches still follows the stage's epochs
            self._step_due.clear()
            try:
                self.maybe_step()
            except Exception as error:  # one failed epoch hook must not stop this worker from following its stage
                self._on_error(error)

    def shutdown(self) -> None:
        self._stop.set()
        self._step_due.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        try:
            self.tracker.shutdown(timeout=5)  # stops its thread, then withdraws its progress record
        except OSError:  # the DHT is down already: hivemind's server takes it down when its own thread fails
            pass


SHARE_SCALINGS = get_args(OptimConfig.model_fields["share_scaling"].annotation)  # "none", "linear", "sqrt"


def step_scale(share_scaling: str, share: float | None) -> float:
    """What a worker's step is multiplied by, given its share of the stage epoch's samples (None: not known)."""
    if share_scaling == "none" or share is None:
        return 1.0
    return share if share_scaling == "linear" else math.sqrt(share)


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every param group's lr multiplied by ``scale`` inside the block, and the very values put back after it."""
    if scale == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    try:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr * scale
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def all_finite(tensors: list[torch.Tensor]) -> bool:
    with torch.no_grad():
        return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)
