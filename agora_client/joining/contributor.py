"""A contributor's worker joining a running swarm.

Its steps: preflight -> authorize -> download -> queue -> sync 1 -> sync 2 -> active.

Everything about the run comes from the swarm's run description (``RunDescription``): the stage is
built from its config, never from a preset; the tokenizer the swarm serves must be the one the
description pins and fit the model's vocabulary, or the worker does not join. The peer key is the
one kept in the config dir for this GPU, so the peer id survives restarts. The worker's port is open
before the join: the auth service dials it back, and while it cannot, the contributor shows the
diagnosis and tries again.

The stage is assigned as soon as the auth service answers, even while the client waits in the
join queue, so the snapshot download and the stage's build run during the queue (StagePreparation)
and are kept when the place clears. Once admitted, the worker starts from the snapshot in sync
phase 1 and the runtime keeps its signed metrics, points estimate, resource probe and ticket fresh
until it is stopped.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import psutil
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth.client import (
    Authorization,
    PeerUnreachable,
    StageAssignment,
    authorize,
    leave,
    renew_ticket,
    report_active,
)
from agora_client.auth.reachability import DialResult, advice
from agora_client.auth.run_description import (
    RunChanged,
    RunDescription,
    RunDescriptionError,
    check_unchanged,
    fetch_tokenizer,
)
from agora_client.auth.ticket_source import HeldTicket
from agora_client.discovery.dht import connect_dht
from agora_client.engine.identity import use_as_process_key
from agora_client.events import EventWriter, QueueEvent, ReachabilityEvent
from agora_client.joining.gpu_fit import JoinFit
from agora_client.joining.network_path import NetworkPath
from agora_client.joining.peer_key import key_path, load_or_create_peer_key, peer_id_of
from agora_client.joining.preflight import machine_checks, reachability_result
from agora_client.joining.preparation import StagePreparation
from agora_client.joining.swarm_view import StageWatch
from agora_client.joining.yield_control import YieldControl
from agora_client.monitor.estimate import estimate_points, fetch_confirmed, fetch_rank
from agora_client.monitor.leaderboard_cli import contributor_url
from agora_client.monitor.records import MetricsRecord, publish_metrics, signed_dht_kwargs
from agora_client.network.outage import Outage
from agora_client.serving.traffic import TrafficWindow
from agora_client.snapshots import download_snapshot
from agora_client.system.gpu import GpuProbe
from agora_client.system.gpu_users import GpuUsers
from agora_client.system.gpu_yield import DEFAULT_GRACE_S, YieldPolicy
from agora_client.system.resources import ResourceProbe
from agora_client.trainer.progress import fetch_progress, swarm_event
from agora_client.worker.metrics import WorkerMetrics
from agora_client.worker.node import WorkerNode, WorkerOptions
from agora_client.worker.prepared_stage import PreparedStage
from agora_client.worker.sync import NAMES

TICK_SECONDS = 1.0
RESOURCES_EVERY = 2.0  # resources and traffic
SWARM_EVERY = 10.0  # the trainers' progress records
RENEW_MARGIN = 300.0  # renew the ticket this many seconds before it expires
DESCRIPTION_EVERY = 60.0  # re-read the run description this often: a changed hash stops the worker
LISTEN_HOST = "0.0.0.0"  # other peers (and the auth service's dial-back) must reach the worker
SNAPSHOT_SERVER = "the swarm's snapshot server"  # never its URL: a presigned one carries a credential
LEAVE_TIMEOUT_S = 3.0  # a stop is done within 10 s: an auth service that does not answer by then lets the ticket expire


class PreflightFailed(RuntimeError):
    """A preflight check failed: the machine cannot serve this swarm as it is; the message says why."""


@dataclass
class ContributorOptions:
    swarm_url: str
    run: RunDescription
    config_dir: Path
    host_port: int
    gpu: int | None = None  # NVML's number (nvidia-smi's); mapped to CUDA's by card identity
    device: str = "cpu"
    device_note: str = ""
    monitor_url: str | None = None
    batch_size_override: int | None = None  # may only lower the microbatch the memory plan allows
    announce_addr: str | None = None  # HOST:PORT other peers should dial, when a NAT or cloud remaps the port
    port_mapping: bool = True  # ask the home router to forward the port (UPnP or NAT-PMP)
    retry_every: float = 30.0  # seconds between join attempts while the worker is unreachable
    insecure: bool = False  # allow plain http:// to the swarm and its snapshots outside loopback and private networks
    yield_policy: YieldPolicy = field(
        default_factory=lambda: YieldPolicy("never")
    )  # the client's --yield, --active-hours
    yield_grace_s: float = DEFAULT_GRACE_S  # how long a yielding worker keeps its slot
    max_upload_mbit: float = 0.0  # the contributor's upload cap (--max-upload-mbit); 0: none

    @property
    def device_name(self) -> str:
        return "cpu" if self.gpu is None else f"gpu{self.gpu}"

    @property
    def snapshot_dir(self) -> Path:
        """Downloaded snapshots of this GPU's runtime (each GPU's runtime downloads on its own)."""
        return self.config_dir / "snapshots" / self.device_name


@dataclass
class _PeerIdentity:
    """This GPU's stored peer key, its peer id and the DHT arguments that sign with it."""

    key: RSAPrivateKey
    peer_id: str
    dht_kwargs: dict  # peer id and metrics signatures share one key


@dataclass
class _Staging:
    """The stage's snapshot download and build (run while queued), behind the check that the GPU fits the stage."""

    preparation: StagePreparation
    fit: JoinFit
    prepare: Callable[[StageAssignment], None]  # the preparation's start, guarded by the fit

    @property
    def gpu_memory(self) -> int | None:
        return self.fit.gpu.capacity if self.fit.gpu is not None else None


class Contributor:
    def __init__(self, options: ContributorOptions, events: EventWriter, stop: threading.Event):
        self.options, self.events, self.stop = options, events, stop
        self.retry_now = (
            threading.Event()
        )  # set by the front end (a key in the app) to retry a failed dial-back at once
        self.auth: Authorization | None = None
        self.node: WorkerNode | None = None
        self.ticket = HeldTicket("")
        self._dht = None
        self.path: NetworkPath | None = None
        self.stage_watch = StageWatch(options.swarm_url, options.run.config.model.stage_names)  # the app's swarm view
        self.gave_way = False  # it yielded the GPU past the grace and left the swarm: join again once the GPU is free

    def run(self, token: str) -> None:
        """Join and serve until stopped; returns early when stopped before the worker is active."""
        identity = self._load_identity()
        self._preflight()
        self._check_tokenizer()
        self._open_port(identity)
        staging = self._start_staging()
        auth = self._authorize(token, identity, staging.gpu_memory, staging.prepare)
        if auth is None:
            return
        self.auth = auth
        prepared = self._prepared_stage(auth, staging)
        if prepared is None:  # stopped
            return
        self._announce_admission(auth)
        node = self._create_node(auth, identity, staging.fit, prepared)
        metrics = self._count_work(node, auth, identity)
        if self.stop.is_set():
            return
        self._start_node(node)
        if self.stop.is_set():
            return
        report_active(self.options.swarm_url, auth.ticket, outage=self._outage(self._auth_service))
        self._serve(node, metrics, identity.dht_kwargs["record_validators"][0])

    def _load_identity(self) -> _PeerIdentity:
        """This GPU's peer key from the config dir (created on the first run), made hivemind's process-wide key."""
        path = key_path(self.options.config_dir, self.options.device_name)
        key = load_or_create_peer_key(path)
        use_as_process_key(key)  # the same peer id as on the last run
        dht_kwargs = signed_dht_kwargs(path)  # peer id and metrics signatures share one key
        return _PeerIdentity(key=key, peer_id=peer_id_of(path), dht_kwargs=dht_kwargs)

    def _open_port(self, identity: _PeerIdentity) -> None:
        """Open the worker's port (its DHT) before the join: the auth service dials it back before admitting us.
        The router is asked to forward it first, so that the DHT announces the forward."""
        options = self.options
        self.path = NetworkPath(
            options.host_port or _free_port(),
            options.swarm_url,
            self.events,
            port_mapping=options.port_mapping,
            announce_addr=options.announce_addr,
            relays=options.run.relays,
            peer_key=identity.key,
            ticket=lambda: self.ticket.ticket,
        )
        self.path.open()
        self._start_dht(identity)

    def _start_dht(self, identity: _PeerIdentity) -> None:
        announce = self.path.announce_maddrs()
        self._dht = connect_dht(
            self.options.run.seeds,
            host=LISTEN_HOST,
            port=self.path.port,
            **({"announce_maddrs": announce} if announce else {}),
            **identity.dht_kwargs,
        )

    def _start_staging(self) -> _Staging:
        """Check the GPU against the run (unfit ones are refused).

        Then get ready to prepare whichever stage is assigned."""
        options = self.options
        config = options.run.config
        preparation = StagePreparation(
            config, options.device, options.snapshot_dir, self.events, lambda: self._outage(SNAPSHOT_SERVER)
        )
        fit = JoinFit(
            config, _cuda_index(options.device), options.batch_size_override, self.events, disk_dir=options.config_dir
        )  # refuses unfit GPUs and hosts
        return _Staging(preparation=preparation, fit=fit, prepare=fit.guard(preparation.start))

    def _prepared_stage(self, auth: Authorization, staging: _Staging) -> tuple[Path | None, PreparedStage] | None:
        """The assigned stage's snapshot and build, once both are ready; None when stopped first."""
        if auth.stage != staging.preparation.stage:  # a re-join in the queue was given another stage
            staging.prepare(StageAssignment(stage=auth.stage, snapshot_url=auth.snapshot_url))
        return staging.preparation.result(self.stop)

    def _announce_admission(self, auth: Authorization) -> None:
        """Hold the admission's ticket and say the queue is passed and the worker is starting."""
        self.ticket.replace(auth.ticket)
        if auth.queued_s == 0:  # admitted at once: say so, or the queue step would pass without a word
            self.events.emit(QueueEvent(position=0, estimated_wait_s=0.0))
        self.events.log("Starting the worker: joining the swarm's DHT and loading the stage...", tag="JOIN")

    def _create_node(
        self,
        auth: Authorization,
        identity: _PeerIdentity,
        fit: JoinFit,
        prepared: tuple[Path | None, PreparedStage],
    ) -> WorkerNode:
        """The worker for the assigned stage, from the prepared snapshot and build, on the DHT opened for the join."""
        options = self.options
        snapshot, built = prepared
        self.node = node = WorkerNode(
            WorkerOptions(
                options.run.config,
                auth.stage,
                list(auth.seeds),
                device=options.device,
                joining=True,
                snapshot=snapshot,
                prepared=built,
                max_batch_size=fit.max_batch_size,
                layout=fit.layout,
                dht_kwargs=identity.dht_kwargs,
                auth_public_key=auth.public_key,
                tickets=self.ticket,
                recovery=lambda: self._download_snapshot(auth.snapshot_url),
                dht=self._dht,
                max_upload_mbit=options.max_upload_mbit,
            ),
            self.events,
        )
        self._dht = None  # the node owns it now
        return node

    def _count_work(self, node: WorkerNode, auth: Authorization, identity: _PeerIdentity) -> WorkerMetrics:
        """The worker's signed metrics, fed by its requests (each in the sync phase it came in) and averaging rounds."""
        metrics = WorkerMetrics(
            self.options.run.config.model,
            auth.stage,
            peer_id=node.peer_id,
            identity=auth.identity,
            ticket=auth.ticket,
        )

        def count(kind: str, tokens) -> None:
            metrics.set_phase(NAMES[node.sync.phase])  # the phase at the time of the request decides if it earns
            metrics.on_forward(tokens) if kind == "forward" else metrics.on_backward(tokens)

        node.add_request_hook(count)
        node.add_round_hook(
            lambda report: metrics.on_sparta_round(report.ok, report.fraction, report.drift_before, report.drift_after)
        )
        return metrics

    def _start_node(self, node: WorkerNode) -> None:
        """Start the worker: it waits for a calm moment in the stage, then passes sync phases 1 and 2."""
        self.events.log(
            "Worker up. Waiting for a calm moment in the stage (no averaging round, early in its step) to "
            "begin sync 1...",
            tag="JOIN",
        )
        node.start(self.stop)

    def _preflight(self) -> None:
        options = self.options
        results = []
        for check in machine_checks(
            options.run, options.swarm_url, options.device, options.device_note, options.config_dir
        ):
            results.append(check())
            self.events.emit(results[-1])  # one by one: the front end shows each as soon as it is known
        failed = [f"{result.check}: {result.reason}" for result in results if result.status == "fail"]
        if failed:
            raise PreflightFailed("preflight failed: " + "; ".join(failed))

    def _check_tokenizer(self) -> None:
        """The swarm's tokenizer against its description and the model.

        RunDescriptionError (not joining) if it differs."""
        tokenizer = fetch_tokenizer(self.options.swarm_url, self.options.run, outage=self._outage(self._auth_service))
        self.events.log(
            f"Tokenizer checked: sha256 {tokenizer.sha256[:16]}, {tokenizer.vocab_size:,} tokens, as the run "
            "description says",
            tag="JOIN",
        )

    def _authorize(
        self,
        token: str,
        identity: _PeerIdentity,
        gpu_memory: int | None,
        on_assigned: Callable[[StageAssignment], None],
    ) -> Authorization | None:
        """Join; while the auth service cannot dial us back, show why and try again (never join unreachable)."""
        options = self.options
        while not self.stop.is_set():
            port, announce = self.path.join_port, self.path.join_announce
            self.events.emit(ReachabilityEvent(status="checking", address=announce or "", port=port))
            try:
                auth = authorize(
                    options.swarm_url,
                    token,
                    identity.peer_id,
                    events=self.events,
                    on_assigned=on_assigned,
                    stop=self.stop,
                    port=port,
                    announce=announce,
                    gpu_memory=gpu_memory,
                    host_memory=psutil.virtual_memory().available if gpu_memory is not None else None,
                    peer_key=identity.key,
                    insecure=options.insecure,
                    outage=self._outage(self._auth_service),
                )
            except PeerUnreachable as error:
                at_once = self.path.relay_untried  # nothing the wait could change: the run's relay is tried now
                self._say_unreachable(error.dial, port, None if at_once else options.retry_every, trying_relay=at_once)
                if not at_once:
                    self._wait_for_retry()
                    if self.stop.is_set():
                        break
                if self.path.open() or self.path.use_relay(error.relay_pass):  # a new way in: the DHT announces it
                    self._dht.shutdown()
                    self._start_dht(identity)
                continue
            self._say_reachable(auth.dial, port)
            return auth
        return None

    def _say_reachable(self, dial: DialResult | None, port: int) -> None:
        """The dial-back that succeeded (if the service made one), how the swarm reaches us, and the check's result."""
        if dial is not None:
            self.events.emit(
                ReachabilityEvent(
                    status="reachable",
                    address=dial.address,
                    port=dial.port,
                    tested_from=dial.tested_from,
                    path=self.path.kind,
                    relay=self.path.relay,
                    relay_cost=self.path.relay_cost(),
                    network=self.path.report(self._seen_address(dial)),
                )
            )
        self.events.emit(reachability_result(dial, port, self.path.describe()))

    def _wait_for_retry(self) -> None:
        """Until the next join attempt is due, the front end asks for one now, or the runtime stops."""
        self.retry_now.clear()
        deadline = time.monotonic() + self.options.retry_every
        while not self.stop.is_set() and not self.retry_now.is_set() and time.monotonic() < deadline:
            self.stop.wait(0.2)

    def _say_unreachable(self, dial: DialResult, port: int, retry_in_s: float | None, *, trying_relay: bool) -> None:
        """The failed dial-back with the network's diagnosis, what to do about it and when the next try comes (or
        that it comes at once, through the run's relay)."""
        network = self.path.report(self._seen_address(dial))
        self.events.emit(reachability_result(dial, port))
        self.events.emit(
            ReachabilityEvent(
                status="unreachable",
                address=dial.address,
                port=dial.port,
                tested_from=dial.tested_from,
                error=dial.error,
                advice=advice(dial, announced=self.path.join_announce is not None, findings=network.findings),
                retry_in_s=retry_in_s,
                trying_relay=trying_relay,
                network=network,
            )
        )

    def _seen_address(self, dial: DialResult) -> str:
        """Where the auth service saw the join come from: the host it dials back, unless the join named one."""
        return dial.host if self.path.join_announce is None else ""

    def _serve(self, node: WorkerNode, metrics: WorkerMetrics, validator) -> None:
        gpu = GpuProbe()
        probe = ResourceProbe(self.options.gpu, gpu=gpu)
        owner = YieldControl(
            self.options.yield_policy, GpuUsers(self.options.gpu, gpu), node, self.events, self.options.yield_grace_s
        )
        traffic = TrafficWindow(
            node.meter,
            upload_cap_bps=node.upload.bytes_per_s if node.upload else None,
            announced_uplink=lambda: node.sparta.announced_link.up,
        )
        last_resources = last_swarm = last_metrics = 0.0
        last_description = time.monotonic()
        previous: MetricsRecord | None = None
        while not self.stop.wait(TICK_SECONDS):
            if self._must_leave(owner):
                break
            if not node.serving:  # the worker would answer nothing while still listed: fail, to be started again
                raise RuntimeError("hivemind's server thread stopped (its error is on the runtime's stderr)")
            metrics.set_phase(None if node.yielding else NAMES[node.sync.phase])  # yielding earns no presence
            now = time.monotonic()
            if now - last_resources >= RESOURCES_EVERY:
                self.events.emit(probe.sample())
                self.events.emit(traffic.sample())
                last_resources = now
            if now - last_swarm >= SWARM_EVERY:
                self._report_swarm(node)
                last_swarm = now
            if now - last_metrics >= self.options.run.config.metrics_period:
                last_metrics = now
                self._renew_ticket(metrics)  # a yielding worker keeps its slot, but publishes and earns nothing
                if not node.yielding:
                    previous = self._publish_metrics(node, metrics, validator, previous, owner)
            if now - last_description >= DESCRIPTION_EVERY:
                last_description = now
                self._check_description()

    def _must_leave(self, owner: YieldControl) -> bool:
        """True when the worker leaves the swarm: nobody reads its events, or it yielded the GPU past the grace."""
        if self.events.broken:  # nobody reads our events any more: leave the swarm cleanly
            self.stop.set()
            return True
        if not owner.tick():  # yielded past the grace: leave (the runtime joins again once the GPU is free)
            self.gave_way = True
            return True
        return False

    def _publish_metrics(
        self, node: WorkerNode, metrics: WorkerMetrics, validator, previous: MetricsRecord | None, owner: YieldControl
    ) -> MetricsRecord:
        """Sign and publish the worker's metrics; say the points they earn and the energy they took."""
        record = metrics.snapshot()
        publish_metrics(node.dht, record, validator, ttl=self.options.run.config.metrics_period * 3)
        points = estimate_points(record, previous, **self._standing(node))
        self.events.emit(points)
        self.events.emit(owner.energy_event(points.presence + points.compute))
        return record

    def _check_description(self) -> None:
        """RunChanged ends the run (the caller exits cleanly).

        A description that cannot be read now is only a warning."""
        try:
            check_unchanged(self.options.swarm_url, self.options.run)
        except RunChanged:
            raise
        except RunDescriptionError as error:
            self.events.log(f"could not re-read the run description: {error}", tag="WARNING", level="warning")

    def _report_swarm(self, node: WorkerNode) -> None:
        """The swarm's learning (trainers' records) and each stage's workers, queue, spot checks and replica drift."""
        try:
            records = fetch_progress(node.dht)
            stages = self.stage_watch.read(node.dht, records, node.options.auth_public_key)
        except Exception as error:  # a DHT hiccup: the next read retries
            self.events.log(f"could not read the swarm's records: {error}", level="debug")
            return
        self.events.emit(swarm_event(records).model_copy(update={"stage": node.options.stage, "stages": stages}))

    def _standing(self, node: WorkerNode) -> dict:
        """The monitor's confirmed points and leaderboard place of this peer (nothing without a monitor)."""
        monitor_url = self.options.monitor_url
        if not monitor_url or self.auth is None:
            return {}
        return {
            "confirmed": fetch_confirmed(monitor_url, node.peer_id),
            "rank": fetch_rank(monitor_url, self.auth.identity),
            "page_url": contributor_url(monitor_url, self.auth.identity),
        }

    def _renew_ticket(self, metrics: WorkerMetrics) -> None:
        auth = self.auth
        if auth is not None and auth.expires_at - time.time() < RENEW_MARGIN:
            ticket, expires_at = renew_ticket(self.options.swarm_url, auth.ticket)
            self.auth = replace(auth, ticket=ticket, expires_at=expires_at)
            self.ticket.replace(ticket)
            metrics.set_ticket(ticket)

    def _download_snapshot(self, url: str | None) -> Path | None:
        """The stage's latest published snapshot (a peer's state), for recovering from broken weights."""
        if not url:
            return None
        return download_snapshot(
            url, self.options.snapshot_dir, events=self.events, outage=self._outage(SNAPSHOT_SERVER)
        )

    @property
    def _auth_service(self) -> str:
        return f"the swarm's auth service at {self.options.swarm_url}"

    def _outage(self, service: str) -> Outage:
        """How a call to ``service`` waits through its outage: the run description was read, so the swarm was
        reached once and a failure now is the service down, not a wrong address."""
        return Outage(service, self.events, self.stop)

    def close(self) -> None:
        """Leave fast at any stage size: the slot, then (in the worker's shutdown) the roster and the averaging
        group, and only then what takes longer at a large stage (the server, finishing the requests in flight)."""
        self._free_slot()  # first: an averaging round in flight may hold the worker's shutdown up to its bound
        if self.node is not None:
            self.node.shutdown()
        if self._dht is not None:  # stopped before the node took it over
            self._dht.shutdown()
        if self.path is not None:  # last: the worker no longer listens behind the router's forward
            self.path.close()

    def _free_slot(self) -> None:
        """Give the slot back to the auth service; a failure only warns."""
        if self.auth is None:
            return
        try:
            leave(self.options.swarm_url, self.auth.ticket, timeout_s=LEAVE_TIMEOUT_S)
        except Exception as error:  # the slot expires with its ticket anyway
            self.events.log(f"could not release the slot: {error}", tag="WARNING", level="warning")


def _free_port() -> int:
    """A TCP port free now, for a worker asked to take any (its router forward is asked for before it listens)."""
    with socket.socket() as probe:
        probe.bind((LISTEN_HOST, 0))
        return probe.getsockname()[1]


def _cuda_index(device: str) -> int | None:
    """N of a "cuda:N" device (CUDA's numbering, already mapped from --gpu); None for the CPU."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else None
