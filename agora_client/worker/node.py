"""A worker: one stage's parameters and optimizer, served to trainers, in lockstep with its stage."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.config import RunConfig
from agora_client.events import ErrorEvent, EventWriter, StageEvent, StepEvent
from agora_client.model import build_stage
from agora_client.snapshots import load_stage_snapshot, save_stage_snapshot
from agora_client.swarm.dht import connect_dht
from agora_client.swarm.roster import WorkerRecord, fetch_roster, free_index, stage_uid
from agora_client.worker.backend import StageBackend
from agora_client.worker.epochs import EpochController
from agora_client.worker.server import StageServer
from agora_client.worker.sparta import RoundReport, SpartaAverager
from agora_client.worker.sync import SyncState


@dataclass
class WorkerOptions:
    config: RunConfig
    stage: str
    seeds: list[str]
    device: str = "cpu"
    joining: bool = False  # start in sync phase 1 (a contributor joining a running swarm)
    host: str = "127.0.0.1"
    num_handlers: int = 2
    index: int | None = None  # uid index (<stage>.0.<index>); default: the lowest free one
    init_seed: int | None = None  # different seeds give different starting weights (tests of averaging)
    slowdown_s: float = 0.0  # added to every request: emulates a slow GPU in tests and benchmarks
    lie: bool = False  # answer random tensors of the right shape: the dishonest worker of the spot-check tests
    snapshot: Path | None = None  # a downloaded stage snapshot to start from
    publish_dir: Path | None = None  # write a snapshot of this stage here every publish_every epochs
    publish_every: int = 5
    publish_keep: int = 3
    exit_snapshot_dir: Path | None = None  # on a graceful stop, save this worker's own state here
    dht_kwargs: dict = field(default_factory=dict)


STABLE_WINDOW_MAX_WAIT = 120.0  # a stage that never looks stable must not keep a joiner out forever


class RequestCounter:
    """Forward / backward requests and the tail's loss since the last epoch, for StepEvents."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.forward = self.backward = 0
        self.loss_sum, self.loss_count = 0.0, 0
        self.since = time.monotonic()

    def on_forward(self, outputs: tuple[torch.Tensor, ...], is_tail: bool) -> None:
        with self._lock:
            self.forward += 1
            if is_tail:
                self.loss_sum += float(outputs[0].sum())
                self.loss_count += outputs[0].numel()

    def on_backward(self) -> None:
        with self._lock:
            self.backward += 1

    def take(self) -> tuple[float, float, float | None]:
        with self._lock:
            minutes = max(time.monotonic() - self.since, 1e-6) / 60
            rates = (self.forward / minutes, self.backward / minutes)
            loss = self.loss_sum / self.loss_count if self.loss_count else None
            self.reset()
        return (*rates, loss)


class WorkerNode:
    def __init__(self, options: WorkerOptions, events: EventWriter):
        self.options, self.events = options, events
        config, stage = options.config, options.stage
        self.device = torch.device(options.device)
        self.dht = connect_dht(options.seeds, host=options.host, **options.dht_kwargs)
        self.peer_id = self.dht.peer_id.to_base58()

        self.module = build_stage(config.model, stage, seed=options.init_seed if options.init_seed is not None else config.seed)
        self.module.to(self.device)
        self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=config.optim.lr, betas=config.optim.betas, weight_decay=config.optim.weight_decay
        )
        index = options.index if options.index is not None else free_index(fetch_roster(self.dht, stage), stage)
        start_epoch = 0
        if options.snapshot is not None:
            start_epoch = load_stage_snapshot(options.snapshot, self.module, self.optimizer, stage=stage).epoch
            events.log(f"restored {stage} from its snapshot at epoch {start_epoch}", tag="DOWNLOAD")
        self.uid = stage_uid(stage, index)
        self.sync = SyncState(config.sync, events.emit, joining=options.joining)
        self.requests = RequestCounter()
        self._request_hooks: list[Callable[[str, torch.Tensor], None]] = []
        self.epochs = EpochController(
            self.dht,
            stage,
            self.parameters,
            self.optimizer,
            target_batch_size=config.optim.target_batch_size,
            clip_norm=config.clip_norm(stage),
            sync=self.sync,
            on_epoch=self._on_epoch,
            on_error=self._on_epoch_error,
            epoch=start_epoch,
        )
        self._round_hooks: list[Callable[[RoundReport], None]] = []
        self._snapshot_due = options.publish_dir is not None  # the first one is written at start()
        self.sparta = SpartaAverager(
            self.dht, f"agora_{stage}_sparta", self.parameters, config.sparta, lock=self.epochs.lock, on_round=self._on_round
        )
        is_tail = stage == "tail"
        max_batch = config.optim.microbatch_size * 8
        example = self.module.example_inputs(1)
        self.backend = StageBackend(
            self.uid,
            self.module,
            epochs=self.epochs,
            device=self.device,
            on_forward=lambda tokens, outputs: self._on_request("forward", tokens, outputs, is_tail),
            on_backward=lambda tokens: self._on_request("backward", tokens, (), is_tail),
            slowdown_s=options.slowdown_s,
            lie=options.lie,
            args_schema=tuple(BatchTensorDescriptor.from_tensor(tensor) for tensor in example),
            min_batch_size=1,
            max_batch_size=max_batch,
        )
        self.server = StageServer(
            self.dht,
            self.backend,
            self.record,
            announce_period=config.announce_period,
            vocab_size=config.model.vocab_size,
            max_batch_size=max_batch,
            num_connection_handlers=options.num_handlers,
            device=self.device,
        )

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            uid=self.uid, peer_id=self.peer_id, stage=self.options.stage, sync_phase=self.sync.phase, epoch=self.epochs.epoch
        )

    def add_round_hook(self, hook: Callable[[RoundReport], None]) -> None:
        """``hook(report)`` runs after every SPARTA round, from the round's thread."""
        self._round_hooks.append(hook)

    def _on_round(self, report: RoundReport) -> None:
        self.events.emit(report.to_event())
        for hook in self._round_hooks:
            hook(report)

    def add_request_hook(self, hook: Callable[[str, torch.Tensor], None]) -> None:
        """``hook(kind, tokens)`` runs after every forward or backward request this worker served."""
        self._request_hooks.append(hook)

    def _on_request(self, kind: str, tokens: torch.Tensor, outputs: tuple[torch.Tensor, ...], is_tail: bool) -> None:
        if kind == "forward":
            self.requests.on_forward(outputs, is_tail)
        else:
            self.requests.on_backward()
        for hook in self._request_hooks:
            hook(kind, tokens)

    def start(self, stop: threading.Event | None = None) -> None:
        self.server.run_in_background(await_ready=True, timeout=120)
        self.epochs.start()
        self.events.emit(StageEvent(stage=self.options.stage, peer_id=self.peer_id))
        self.events.log(f"serving {self.uid} as peer {self.peer_id}", tag="TRAINING")
        if self.options.publish_dir is not None:  # joiners always find a snapshot, even before the first epoch
            self.publish_snapshot(self.epochs.epoch)
        if self.sync.target_epoch is None:  # a joiner: start phase 1 in a stable window
            self._wait_for_stable_window(stop or threading.Event())
            self.sync.begin(self.epochs.stage_epoch)
            self.server.announcer.refresh.set()

    def _wait_for_stable_window(self, stop: threading.Event) -> None:
        """Wait until no averaging round is in flight and the stage is early in its epoch."""
        period = self.options.config.sparta.period
        deadline = time.monotonic() + STABLE_WINDOW_MAX_WAIT
        while not stop.is_set() and time.monotonic() < deadline:
            progress = self.epochs.tracker.global_progress
            in_round_epoch = progress.epoch > 0 and progress.epoch % period == 0
            if not in_round_epoch and progress.samples_accumulated < progress.target_batch_size / 2:
                return
            stop.wait(0.5)

    def _on_epoch_error(self, error: Exception) -> None:
        self.events.emit(ErrorEvent(message=f"{error.__class__.__name__}: {error}", where="stage epoch"))

    def _on_epoch(self, epoch: int) -> None:
        phase = self.sync.phase
        self.sync.on_epoch(epoch, self.epochs.stage_epoch)
        if self.sync.phase != phase:
            self.server.announcer.refresh.set()
        forward_rate, backward_rate, loss = self.requests.take()
        self.events.emit(
            StepEvent(
                stage=self.options.stage,
                local_epoch=epoch,
                forward_per_min=round(forward_rate, 2),
                backward_per_min=round(backward_rate, 2),
                loss=loss,
            )
        )
        period = self.options.config.sparta.period
        if epoch > 0 and epoch % period == 0:
            self.sparta.begin_round(epoch // period, self.sync.averaging_weight)
        if self.options.publish_dir is not None:
            self._snapshot_due |= epoch % self.options.publish_every == 0
            if self._snapshot_due and not self.sparta.in_flight:  # only outside averaging rounds: a consistent state
                self.publish_snapshot(epoch)

    def publish_snapshot(self, epoch: int) -> Path:
        """Write this stage's snapshot; under the lock, so weights and optimizer state are consistent."""
        with self.epochs.lock:
            self._snapshot_due = False
            return save_stage_snapshot(
                self.options.publish_dir, self.options.stage, self.module, self.optimizer, epoch, self.options.publish_keep
            )

    def shutdown(self) -> None:
        self.sparta.shutdown()  # leaves its averaging group first, so peers need not wait for us
        self.epochs.shutdown()
        if self.options.exit_snapshot_dir is not None:
            with self.epochs.lock:
                save_stage_snapshot(
                    self.options.exit_snapshot_dir, self.options.stage, self.module, self.optimizer, self.epochs.epoch, 1
                )
        self.server.shutdown()
        self.server.join(timeout=10)

