"""A contributor's worker joining a running swarm: authorize -> download -> queue -> sync 1 -> sync 2 -> active.

The stage is assigned as soon as the auth service answers, even while the client waits in the
join queue, so the snapshot download runs during the queue and is kept when the place clears.
Once admitted, the worker starts from the snapshot in sync phase 1 and the runtime keeps its
signed metrics, points estimate, resource probe and ticket fresh until it is stopped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from agora_client.auth.client import Authorization, StageAssignment, authorize, leave, renew_ticket, report_active
from agora_client.config import RunConfig
from agora_client.events import EventWriter
from agora_client.monitor.estimate import estimate_points, fetch_confirmed
from agora_client.monitor.records import MetricsRecord, publish_metrics, signed_dht_kwargs
from agora_client.snapshots import DownloadError, download_snapshot
from agora_client.system.resources import ResourceProbe
from agora_client.worker.metrics import WorkerMetrics
from agora_client.worker.node import WorkerNode, WorkerOptions
from agora_client.worker.sync import NAMES

TICK_SECONDS = 1.0
RESOURCES_EVERY = 2.0
METRICS_EVERY = 15.0
RENEW_MARGIN = 300.0  # renew the ticket this many seconds before it expires


@dataclass
class ContributorOptions:
    swarm_url: str
    config: RunConfig
    config_dir: Path
    gpu: int | None = None
    monitor_url: str | None = None
    lie: bool = False  # tests only: a dishonest worker (see WorkerOptions.lie)

    @property
    def device(self) -> str:
        if self.gpu is not None and torch.cuda.is_available():
            return f"cuda:{self.gpu}"
        return "cpu"

    @property
    def device_name(self) -> str:
        return "cpu" if self.gpu is None else f"gpu{self.gpu}"


class SnapshotFetch:
    """Downloads the assigned stage's snapshot in the background (it may start while queued)."""

    def __init__(self, destination: Path, events: EventWriter):
        self.destination, self.events = destination, events
        self.path: Path | None = None
        self.error: Exception | None = None
        self._thread: threading.Thread | None = None

    def start(self, assignment: StageAssignment) -> None:
        if self._thread is None and assignment.snapshot_url:
            self._thread = threading.Thread(target=self._run, args=(assignment.snapshot_url,), daemon=True)
            self._thread.start()

    def _run(self, url: str) -> None:
        try:
            self.path = download_snapshot(url, self.destination, events=self.events)
        except (DownloadError, OSError) as error:
            self.error = error

    def result(self) -> Path | None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.path


class Contributor:
    def __init__(self, options: ContributorOptions, events: EventWriter, stop: threading.Event):
        self.options, self.events, self.stop = options, events, stop
        self.auth: Authorization | None = None
        self.node: WorkerNode | None = None

    def run(self, token: str) -> None:
        options = self.options
        identity_path = options.config_dir / "identity" / f"{options.device_name}.key"
        dht_kwargs = signed_dht_kwargs(identity_path)  # peer id and metrics signatures share one key
        peer_id = _peer_id_of(identity_path)
        fetch = SnapshotFetch(options.config_dir / "snapshots", self.events)
        self.auth = auth = authorize(
            options.swarm_url, token, peer_id, events=self.events, on_assigned=fetch.start, stop=self.stop
        )
        fetch.start(StageAssignment(stage=auth.stage, snapshot_url=auth.snapshot_url))
        snapshot = fetch.result()
        if self.stop.is_set():
            return
        self.node = node = WorkerNode(
            WorkerOptions(
                options.config,
                auth.stage,
                list(auth.seeds),
                device=options.device,
                joining=True,
                snapshot=snapshot,
                exit_snapshot_dir=options.config_dir / "snapshots" / "own",
                dht_kwargs=dht_kwargs,
                lie=options.lie,
            ),
            self.events,
        )
        metrics = WorkerMetrics(options.config.model, auth.stage, peer_id=node.peer_id, identity=auth.identity, ticket=auth.ticket)
        node.add_request_hook(lambda kind, tokens: metrics.on_forward(tokens) if kind == "forward" else metrics.on_backward(tokens))
        node.add_round_hook(lambda report: metrics.on_sparta_round(report.ok, report.fraction))
        node.start(self.stop)
        report_active(options.swarm_url, auth.ticket)
        self._serve(node, metrics, dht_kwargs["record_validators"][0])

    def _serve(self, node: WorkerNode, metrics: WorkerMetrics, validator) -> None:
        probe = ResourceProbe(self.options.gpu)
        last_resources = last_metrics = 0.0
        previous: MetricsRecord | None = None
        while not self.stop.wait(TICK_SECONDS):
            if self.events.broken:  # nobody reads our events any more: leave the swarm cleanly
                self.stop.set()
                break
            metrics.set_phase(NAMES[node.sync.phase])
            now = time.monotonic()
            if now - last_resources >= RESOURCES_EVERY:
                self.events.emit(probe.sample())
                last_resources = now
            if now - last_metrics >= METRICS_EVERY:
                self._renew_ticket(metrics)
                record = metrics.snapshot()
                publish_metrics(node.dht, record, validator, ttl=METRICS_EVERY * 3)
                confirmed = fetch_confirmed(self.options.monitor_url, node.peer_id) if self.options.monitor_url else None
                self.events.emit(estimate_points(record, previous, confirmed=confirmed))
                previous, last_metrics = record, now

    def _renew_ticket(self, metrics: WorkerMetrics) -> None:
        auth = self.auth
        if auth is not None and auth.expires_at - time.time() < RENEW_MARGIN:
            ticket, expires_at = renew_ticket(self.options.swarm_url, auth.ticket)
            self.auth = replace(auth, ticket=ticket, expires_at=expires_at)
            metrics.set_ticket(ticket)

    def close(self) -> None:
        """Leave gracefully: finish the current request, leave the stage, free the slot."""
        if self.node is not None:
            self.node.shutdown()
        if self.auth is not None:
            try:
                leave(self.options.swarm_url, self.auth.ticket)
            except Exception as error:  # the slot expires with its ticket anyway
                self.events.log(f"could not release the slot: {error}", tag="WARNING", level="warning")


def _peer_id_of(identity_path: Path) -> str:
    from hivemind.p2p import PeerID

    return PeerID.from_identity(identity_path.read_bytes()).to_base58()
