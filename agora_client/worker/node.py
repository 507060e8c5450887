"""A worker: one stage's parameters and optimizer, served to trainers, in lockstep with its stage."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.config import RunConfig
from agora_client.events import EventWriter, StageEvent, StepEvent
from agora_client.model import build_stage
from agora_client.swarm.dht import connect_dht
from agora_client.swarm.roster import WorkerRecord, fetch_roster, free_index, stage_uid
from agora_client.worker.backend import StageBackend
from agora_client.worker.epochs import EpochController
from agora_client.worker.server import StageServer
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
    dht_kwargs: dict = field(default_factory=dict)


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
    def __init__(self, options: WorkerOptions, events: EventWriter, *, epoch_hooks: list[Callable[[int], None]] = ()):
        self.options, self.events = options, events
        config, stage = options.config, options.stage
        self.device = torch.device(options.device)
        self.dht = connect_dht(options.seeds, host=options.host, **options.dht_kwargs)
        self.peer_id = self.dht.peer_id.to_base58()

        torch.manual_seed(config.seed)
        self.module = build_stage(config.model, stage, seed=options.init_seed if options.init_seed is not None else config.seed)
        self.module.to(self.device)
        self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=config.optim.lr, betas=config.optim.betas, weight_decay=config.optim.weight_decay
        )
        index = options.index if options.index is not None else free_index(fetch_roster(self.dht, stage), stage)
        self.uid = stage_uid(stage, index)
        self.sync = SyncState(config.sync, events.emit, joining=options.joining)
        self.requests = RequestCounter()
        self._epoch_hooks = list(epoch_hooks)
        self.epochs = EpochController(
            self.dht,
            stage,
            self.parameters,
            self.optimizer,
            target_batch_size=config.optim.target_batch_size,
            clip_norm=config.clip_norm(stage),
            sync=self.sync,
            on_epoch=self._on_epoch,
        )
        is_tail = stage == "tail"
        max_batch = config.optim.microbatch_size * 8
        example = self.module.example_inputs(1)
        self.backend = StageBackend(
            self.uid,
            self.module,
            epochs=self.epochs,
            device=self.device,
            on_forward=lambda tokens, outputs: self.requests.on_forward(outputs, is_tail),
            on_backward=lambda tokens: self.requests.on_backward(),
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

    def add_epoch_hook(self, hook: Callable[[int], None]) -> None:
        self._epoch_hooks.append(hook)

    def start(self) -> None:
        self.server.run_in_background(await_ready=True, timeout=120)
        self.events.emit(StageEvent(stage=self.options.stage, peer_id=self.peer_id))
        self.events.log(f"serving {self.uid} as peer {self.peer_id}", tag="TRAINING")

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
        for hook in self._epoch_hooks:
            hook(epoch)

    def shutdown(self) -> None:
        self.epochs.shutdown()
        self.server.shutdown()
        self.server.join(timeout=10)

