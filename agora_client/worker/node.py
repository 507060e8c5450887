"""A worker: one stage's parameters and optimizer, served to trainers, in lockstep with its stage."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from hivemind import DHT

from agora_client.auth.ticket_source import TicketSource
from agora_client.averaging.group_admission import GroupAdmission
from agora_client.averaging.partition import due_round
from agora_client.averaging.sparta import RoundReport, SpartaAverager
from agora_client.checkpoints.writer import CheckpointWriter
from agora_client.config import RunConfig
from agora_client.discovery.dht import connect_dht
from agora_client.discovery.roster import WorkerRecord, averaging_workers, fetch_roster, free_index, stage_uid
from agora_client.events import ErrorEvent, EventWriter, StageEvent, StepEvent
from agora_client.model.layers import native_bf16
from agora_client.serving.backend import StageBackend
from agora_client.serving.device_copy import DeviceCopy
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.server import StageServer
from agora_client.serving.ticket_gate import TicketGate
from agora_client.serving.traffic import MeterTotals, RequestMeter
from agora_client.snapshots import SnapshotError, load_stage_snapshot, open_store, remove_other_downloads
from agora_client.snapshots.background import BackgroundWriter
from agora_client.snapshots.publisher import SnapshotPublisher
from agora_client.upload_cap import UploadCap
from agora_client.worker.epochs import EpochController, all_finite
from agora_client.worker.optimizer import build_optimizer
from agora_client.worker.prepared_stage import PreparedStage, prepare_stage
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
    snapshot: Path | None = None  # a downloaded stage snapshot to start from
    publish_dir: Path | str | None = None  # snapshot store (directory or s3://) written every publish_every epochs
    publish_every: int = 5
    publish_keep: int = 3
    max_batch_size: int | None = None  # sequences per pass (the GPU fit check's); default 8 microbatches
    layout: str = "fp32"  # the GPU fit check's (model/memory.py LAYOUTS); "offload": fp32 masters on the host
    checkpoint_store: str | None = None  # timestamped checkpoints every config.checkpoint.period_s (directory or s3://)
    dht_kwargs: dict = field(default_factory=dict)
    auth_public_key: str | None = None  # the auth service's key: callers must present its tickets (None: open worker)
    tickets: TicketSource | None = None  # this worker's own ticket, presented to same-stage peers when averaging
    recovery: Callable[[], Path | None] | None = None  # fetches a peer's stage snapshot after this worker broke
    dht: DHT | None = (
        None  # a DHT peer already started (a contributor opens its port before joining); owned from here on
    )
    prepared: PreparedStage | None = (
        None  # the stage built ahead (a contributor builds it while its snapshot downloads)
    )
    max_upload_mbit: float = 0.0  # the contributor's upload cap (answers, SPARTA, probes); 0: none


STABLE_WINDOW_MAX_WAIT = 120.0  # a stage that never looks stable must not keep a joiner out forever
WRITE_WAIT_AT_STOP_S = 5.0  # a stop waits this long for a snapshot being written; an abandoned one never appears


class EpochStats:
    """Requests served (from the meter) and the tail's loss since the last epoch, for StepEvents."""

    def __init__(self, meter: RequestMeter):
        self.meter = meter
        self._lock = threading.Lock()
        self._reset(meter.totals())

    def _reset(self, totals: MeterTotals) -> None:
        self._base, self._since = totals, time.monotonic()
        self.loss_sum, self.loss_count = 0.0, 0

    def on_tail_outputs(self, outputs: tuple[torch.Tensor, ...]) -> None:
        with self._lock:
            self.loss_sum += float(outputs[0].sum())
            self.loss_count += outputs[0].numel()

    def take(self) -> tuple[float, float, float | None]:
        """(forward per minute, backward per minute, mean tail loss or None) since the last call."""
        totals = self.meter.totals()
        with self._lock:
            minutes = max(time.monotonic() - self._since, 1e-6) / 60
            rates = ((totals.forward - self._base.forward) / minutes, (totals.backward - self._base.backward) / minutes)
            loss = self.loss_sum / self.loss_count if self.loss_count else None
            self._reset(totals)
        return (*rates, loss)


class WorkerNode:
    """One stage's worker: its DHT peer, parameters, optimizer and epochs, SPARTA averager and moe server."""

    def __init__(self, options: WorkerOptions, events: EventWriter):
        self.options, self.events = options, events
        self.device = torch.device(options.device)
        if options.prepared is not None:
            _check_prepared(options.prepared, options.stage, options.snapshot)
        self.dht = options.dht or connect_dht(options.seeds, host=options.host, **options.dht_kwargs)
        self.peer_id = self.dht.peer_id.to_base58()
        prepared, start_epoch = self._load_stage()
        self._health_lock = threading.Lock()
        self._build_gates(options, events)
        self.sync = SyncState(options.config.sync, events.emit, joining=options.joining)
        self.meter = RequestMeter()  # before the server: its connection handlers fork with it
        # before the server and the averager too: their processes spend the one budget
        self.upload = UploadCap(options.max_upload_mbit) if options.max_upload_mbit else None
        self.requests = EpochStats(self.meter)
        self._request_hooks: list[Callable[[str, torch.Tensor], None]] = []
        self._round_hooks: list[Callable[[RoundReport], None]] = []
        self.epochs = self._epoch_controller(start_epoch)
        self._last_epoch = start_epoch  # the epoch of the previous epoch hook: rounds crossed by a jump still start
        self._weights_epoch = start_epoch  # the stage epoch its weights are from: how fresh they are at phase 1
        self._snapshot_due = options.publish_dir is not None  # the first one is written at start()
        self._yielded: tuple[int, int] | None = None  # (stage epoch, sync phase) when it yielded the GPU; None: serving
        self.state_writer = BackgroundWriter(
            self.module, self.optimizer, self.epochs.lock.state
        )  # buffers on first use
        self.snapshots = self._snapshot_publisher()
        self.checkpoints = self._checkpoint_writer()
        self.sparta = self._sparta_averager()
        self.backend = self._stage_backend(prepared)
        self.server = StageServer(
            self.dht,
            self.backend,
            self.record,
            announce_period=options.config.announce_period,
            vocab_size=options.config.model.vocab_size,
            # the largest microbatch a trainer of this run sends
            max_request_batch=options.config.optim.microbatch_size,
            gate=self.call_gate,
            rejections=self.rejections,
            num_connection_handlers=options.num_handlers,
            device=self.device,
            meter=self.meter,
            upload=self.upload,
        )

    def _load_stage(self) -> tuple[PreparedStage, int]:
        """The stage's module, parameters, optimizer and uid; returns the stage and its epoch (the snapshot's, or 0)."""
        options, config, stage = self.options, self.options.config, self.options.stage
        seed = options.init_seed if options.init_seed is not None else config.seed
        prepared = options.prepared or prepare_stage(
            config,
            stage,
            self.device,
            seed=seed,
            seeded_weights=options.snapshot is None,  # a snapshot sets every weight below
            layout=options.layout,
        )
        self.module = prepared.module  # the masters: what the optimizer, SPARTA, snapshots and checkpoints read
        self.device_copy = None
        if options.layout == "offload":
            if next(self.module.parameters()).device.type != "cpu":
                raise ValueError("the offload layout keeps the stage's master weights on the host: prepare it on cpu")
            self.device_copy = DeviceCopy(self.module, config.model, self.device, seed=seed)
        self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.parameters, config)
        index = options.index if options.index is not None else free_index(fetch_roster(self.dht, stage), stage)
        start_epoch = 0
        if options.snapshot is not None:
            start_epoch = load_stage_snapshot(options.snapshot, self.module, self.optimizer, stage=stage).epoch
            self.events.log(f"restored {stage} from its snapshot at epoch {start_epoch}", tag="DOWNLOAD")
        self.uid = stage_uid(stage, index)
        return prepared, start_epoch

    def _epoch_controller(self, start_epoch: int) -> EpochController:
        config, events = self.options.config, self.events
        return EpochController(
            self.dht,
            self.options.stage,
            self.parameters,
            self.optimizer,
            target_batch_size=config.optim.target_batch_size,
            clip_norm=config.clip_norm(self.options.stage),
            sync=self.sync,
            on_epoch=self._on_epoch,
            on_error=self._on_epoch_error,
            on_skipped_step=lambda message: events.log(message, tag="TRAINING", level="warning"),
            on_corrupt_weights=self.mark_unhealthy,
            epoch=start_epoch,
            share_scaling=config.optim.share_scaling,
        )

    def _snapshot_publisher(self) -> SnapshotPublisher | None:
        options = self.options
        if options.publish_dir is None:
            return None
        return SnapshotPublisher(
            open_store(options.publish_dir), options.stage, self.state_writer, options.publish_keep, self.events
        )

    def _checkpoint_writer(self) -> CheckpointWriter | None:
        if self.options.checkpoint_store is None:
            return None
        return CheckpointWriter(
            open_store(self.options.checkpoint_store),
            self.options.config,
            self.options.stage,
            self.state_writer,
            grad_norm=lambda: self.epochs.last_grad_norm,
            events=self.events,
        )

    def _sparta_averager(self) -> SpartaAverager:
        return SpartaAverager(
            self.dht,
            f"agora_{self.options.stage}_sparta",
            self.parameters,
            self.options.config.sparta,
            lock=self.epochs.lock,
            on_round=self._on_round,
            stage_size=lambda: averaging_workers(fetch_roster(self.dht, self.options.stage)),  # in the round's thread
            admission=None
            if self.averaging_gate is None
            else GroupAdmission(self.averaging_gate, self.options.tickets, self.rejections),
            upload=self.upload,
        )

    def _stage_backend(self, prepared: PreparedStage) -> StageBackend:
        config = self.options.config
        if config.use_mixed_precision and not native_bf16(self.device) and self.device_copy is None:
            self.events.log(
                f"no native bf16 on this {self.device.type} (emulated bf16 is slower than fp32): the stage "
                "computes in fp32, not under the run's bf16 autocast",
                tag="TRAINING",
            )
        is_tail = self.options.stage == "tail"
        return StageBackend(
            self.uid,
            self.module if self.device_copy is None else self.device_copy.module,
            device_copy=self.device_copy,
            lock=self.epochs.lock.training,
            on_samples=self.epochs.on_samples,
            device=self.device,
            mixed_precision=config.use_mixed_precision,
            on_forward=lambda tokens, outputs: self._on_request("forward", tokens, outputs, is_tail),
            on_backward=lambda tokens: self._on_request("backward", tokens, (), is_tail),
            on_unhealthy=self.mark_unhealthy,
            args_schema=prepared.args_schema,
            outputs_schema=prepared.outputs_schema,
            min_batch_size=1,
            max_batch_size=self.options.max_batch_size or config.optim.microbatch_size * 8,
        )

    def _build_gates(self, options: WorkerOptions, events: EventWriter) -> None:
        """Ticket checks for trainer calls and (through ``averaging_gate``) for same-stage averaging."""
        self.rejections = RejectionLog(lambda message: events.log(message, tag="SECURITY", level="warning"))
        if options.auth_public_key is None:
            self.call_gate = self.averaging_gate = None
            events.log(
                "no auth public key given: this worker serves callers without tickets", tag="WARNING", level="warning"
            )
            return
        self.call_gate = TicketGate(options.auth_public_key, roles=("trainer",))
        self.averaging_gate = TicketGate(options.auth_public_key, roles=("worker",), stage=options.stage)
        if options.tickets is None:
            events.log(
                "this worker holds no ticket of its own: the stage's other workers will not average with it "
                "(pass --ticket-key, or join through the auth service)",
                tag="WARNING",
                level="warning",
            )

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            uid=self.uid,
            peer_id=self.peer_id,
            stage=self.options.stage,
            sync_phase=self.sync.phase,
            epoch=self.epochs.epoch,
            healthy=self.healthy,
            yielding=self.yielding,
        )

    @property
    def healthy(self) -> bool:
        return bool(self.server.healthy.value)

    @property
    def serving(self) -> bool:
        """Whether hivemind's server thread, which runs every request, still runs (once started): an error there ends
        it for good (torch's shared-memory manager timing out under load did), and the worker answers nothing."""
        return self.server.is_alive()

    @property
    def yielding(self) -> bool:
        return self._yielded is not None

    def yield_gpu(self) -> None:
        """Drain for the GPU's owner: leave routing (the roster says so, handlers refuse new calls) and skip SPARTA
        rounds; requests in flight and a round already averaging finish. The slot and the DHT peer stay."""
        if self._yielded is not None:
            return
        self._yielded = (self.epochs.stage_epoch, self.sync.phase)
        self.server.yielding.value = True
        self.server.announcer.refresh.set()

    def resume(self) -> None:
        """Serve again. Weights that fell behind while yielding (more than ``max_allowed_stale`` stage epochs, or a
        sync that the yield interrupted) are synced with peers first, as a joiner's are."""
        if self._yielded is None:
            return
        (epoch, phase), self._yielded = self._yielded, None
        if phase != 0 or self.epochs.stage_epoch - epoch > self.options.config.sync.max_allowed_stale:
            self.sync.begin(self.epochs.stage_epoch)
        self.server.yielding.value = False
        self.server.announcer.refresh.set()

    def mark_unhealthy(self, reason: str) -> None:
        """Leave routing (handlers refuse, the roster says unhealthy) until a peer's state has been reloaded."""
        with self._health_lock:
            if not self.server.healthy.value:
                return
            self.server.healthy.value = False
        self.events.emit(
            ErrorEvent(
                message=f"this worker is unhealthy: {reason}",
                hint="it left routing and reloads its stage's latest snapshot, then re-syncs with its peers",
                where="worker health",
            )
        )
        self.server.announcer.refresh.set()
        threading.Thread(target=self._recover, name="recover", daemon=True).start()

    def _recover(self) -> None:
        if self.options.recovery is None:
            self.events.log(
                "no snapshot source to recover from: restart this worker to rejoin", tag="WARNING", level="warning"
            )
            return
        try:
            path = self.options.recovery()
            if path is None:
                raise SnapshotError("no snapshot of this stage has been published yet")
            with self.epochs.lock:
                info = load_stage_snapshot(path, self.module, self.optimizer, stage=self.options.stage)
                # what compression dropped from the old weights is not sent with these
                self.sparta.parameters_replaced()
                self.optimizer.zero_grad(set_to_none=True)
                if not all_finite(self.parameters):
                    raise SnapshotError(f"the snapshot at {path} holds non-finite weights")
        except Exception as error:  # stay out of routing; a restart rejoins through the join flow
            self.events.emit(
                ErrorEvent(message=f"could not recover: {error}", hint="restart this worker", where="worker health")
            )
            return
        remove_other_downloads(path)  # the snapshot just loaded is the one in use now
        self.sync.begin(self.epochs.stage_epoch)  # re-sync weights with peers before serving trainers again
        self.server.healthy.value = True
        self.server.announcer.refresh.set()
        self.events.log(
            f"reloaded the {self.options.stage} snapshot of epoch {info.epoch}; re-syncing with peers", tag="SYNC"
        )

    def add_round_hook(self, hook: Callable[[RoundReport], None]) -> None:
        """``hook(report)`` runs after every SPARTA round, from the round's thread."""
        self._round_hooks.append(hook)

    def _on_round(self, report: RoundReport) -> None:
        self.meter.on_transfer(report.bytes_sent, report.bytes_received)
        self.events.emit(report.to_event(self.sparta.partition))
        for peer, problem in report.suspects:
            self.events.log(
                f"SPARTA round {report.round}: peer {peer} {problem}; its pull on our weights was bounded",
                tag="SPARTA",
                level="warning",
            )
        if report.notice is not None:
            self.events.log(f"SPARTA: {report.notice}", tag="SPARTA", level="warning")
        if report.uplink is not None:
            self.events.log(f"SPARTA: {report.uplink}", tag="SPARTA")
        for hook in self._round_hooks:
            hook(report)

    def add_request_hook(self, hook: Callable[[str, torch.Tensor], None]) -> None:
        """``hook(kind, tokens)`` runs after every forward or backward batch this worker computed (the runtime
        may merge several requests into one batch: ``self.meter`` counts requests)."""
        self._request_hooks.append(hook)

    def _on_request(self, kind: str, tokens: torch.Tensor, outputs: tuple[torch.Tensor, ...], is_tail: bool) -> None:
        if kind == "forward" and is_tail:
            self.requests.on_tail_outputs(outputs)
        for hook in self._request_hooks:
            hook(kind, tokens)

    def start(self, stop: threading.Event | None = None) -> None:
        self.rejections.start()
        self.server.run_in_background(await_ready=True, timeout=120)
        self.epochs.start()
        self.events.emit(StageEvent(stage=self.options.stage, peer_id=self.peer_id))
        self.events.log(f"serving {self.uid} as peer {self.peer_id}", tag="TRAINING")
        if self.options.publish_dir is not None:  # joiners always find a snapshot, even before the first epoch
            self.publish_snapshot(self.epochs.epoch)
        if self.sync.target_epoch is None:  # a joiner: start phase 1 in a stable window
            self._wait_for_stable_window(stop or threading.Event())
            self.sync.begin(self.epochs.stage_epoch, weights_epoch=self._weights_epoch)
            self.server.announcer.refresh.set()

    def _wait_for_stable_window(self, stop: threading.Event) -> None:
        """Wait until no averaging round is in flight and the stage is early in its epoch."""
        period = self.options.config.sparta.period
        deadline = time.monotonic() + STABLE_WINDOW_MAX_WAIT
        while not stop.is_set() and time.monotonic() < deadline:
            progress = self.epochs.tracker.global_progress
            if (
                due_round(progress.epoch, period) is None
                and progress.samples_accumulated < progress.target_batch_size / 2
            ):
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
                stage_share=self.epochs.last_share,
            )
        )
        round_no = due_round(epoch, self.options.config.sparta.period, since=self._last_epoch)
        self._last_epoch = epoch
        if round_no is not None and not self.yielding:  # a yielding worker leaves averaging to its peers
            self.sparta.begin_round(round_no, self.sync.averaging_weight)
        if self.checkpoints is not None:
            self.checkpoints.on_epoch(epoch, loss, averaging=self.sparta.in_flight)
        if self.options.publish_dir is not None:
            self._snapshot_due |= epoch % self.options.publish_every == 0
            if self._snapshot_due and not self.sparta.in_flight and self.healthy:  # consistent and finite states only
                self.publish_snapshot(epoch)

    def publish_snapshot(self, epoch: int) -> None:
        """Start writing this stage's snapshot: copied under the lock (weights and optimizer state are consistent),
        written in the background; skipped, and said, while the previous write is in flight."""
        self._snapshot_due = False
        self.snapshots.publish(epoch)

    def shutdown(self) -> None:
        """Leave the roster and the averaging group first, then stop what may take long at a large stage."""
        if self.server.announcer.is_alive():  # withdraws the roster record: trainers stop routing to us
            self.server.announcer.stop.set()
            self.server.announcer.join(timeout=5)
        self.sparta.shutdown()  # leaves its averaging group, so peers need not wait for us
        self.epochs.shutdown()
        self.events.log(
            f"the longest a request waited for the stage lock: {self.backend.longest_lock_wait_s:.3f} s", tag="TRAINING"
        )
        if not self.state_writer.wait(WRITE_WAIT_AT_STOP_S):
            self.events.log(
                f"still writing the stage's state after {WRITE_WAIT_AT_STOP_S:.0f} s: a snapshot is abandoned at "
                "exit (it never becomes visible in the store), a checkpoint is waited for",
                tag="SNAPSHOT",
                level="warning",
            )
        if self.checkpoints is not None:
            self.checkpoints.close(self.epochs.epoch)  # a stopped swarm resumes from where it stopped
        if self.server.ident is not None:
            self.server.shutdown()  # its DHT too
            self.server.join(timeout=10)
        else:  # stopped before start(): of the server, only the DHT runs yet (hivemind's shutdown assumes a start)
            self.dht.shutdown()
        self.rejections.shutdown()


def _check_prepared(prepared: PreparedStage, stage: str, snapshot: Path | None) -> None:
    if prepared.stage != stage:
        raise ValueError(f"the prepared stage is {prepared.stage}, not {stage}")
    if not prepared.seeded and snapshot is None:
        raise ValueError(f"the {stage} stage was prepared without weights, and no snapshot gives it any")
