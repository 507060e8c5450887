"""A worker's series for operators: requests served and refused, bytes moved, SPARTA rounds by outcome and the
latest one's drift, and its sync phase, epoch and health.

Requests and bytes are the worker's traffic meter (serving/traffic.py), refusals its rejection log, the phase,
epoch and health its roster record; SPARTA rounds are counted here, from the reports the node hands its round hooks,
and so is their drift (the figure the signed metrics record carries, worker/metrics.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from agora_client.operator_metrics import Series, SeriesCollector, Values
from agora_client.worker.sync import NAMES

if TYPE_CHECKING:
    from agora_client.averaging.sparta import RoundReport
    from agora_client.discovery.roster import WorkerRecord
    from agora_client.serving.rejections import RejectionLog
    from agora_client.serving.traffic import RequestMeter
    from agora_client.worker.node import WorkerNode

REQUESTS = Series("agora_worker_rpc_requests", "counter", "trainer requests answered", ("stage", "kind"))
REFUSED = Series(
    "agora_worker_rpc_refused",
    "counter",
    "requests refused (trainer calls and averaging joins: bad ticket, size, values, an unhealthy worker), by reason",
    ("stage", "reason"),
)
BYTES = Series(
    "agora_worker_bytes", "counter", "payload bytes of requests, replies and SPARTA messages", ("stage", "direction")
)
SPARTA_ROUNDS = Series(
    "agora_worker_sparta_rounds",
    "counter",
    "SPARTA rounds by outcome: averaged, or failed (no group, timed out, skipped)",
    ("stage", "outcome"),
)
SPARTA_DRIFT = Series(
    "agora_worker_sparta_drift",
    "gauge",
    "relative L2 of the slice the latest SPARTA round averaged "
    "from its group's average, before and after the update (averaging/drift.py); absent until a "
    "round has averaged",
    ("stage", "when"),
)
PHASE = Series(
    "agora_worker_sync_phase", "gauge", "1 for the worker's sync phase now (sync1, sync2, active)", ("stage", "phase")
)
EPOCH = Series("agora_worker_epoch", "gauge", "the worker's local epoch", ("stage",))
HEALTHY = Series("agora_worker_healthy", "gauge", "1 while the worker's weights and outputs are finite", ("stage",))
SERIES = (REQUESTS, REFUSED, BYTES, SPARTA_ROUNDS, SPARTA_DRIFT, PHASE, EPOCH, HEALTHY)


class WorkerCollector(SeriesCollector):
    """Reads ``meter``, ``rejections`` and ``record()`` at every scrape; ``on_round`` counts each SPARTA round."""

    def __init__(self, stage: str, meter: RequestMeter, rejections: RejectionLog, record: Callable[[], WorkerRecord]):
        super().__init__(SERIES, self._values)
        self.stage, self._meter, self._rejections, self._record = stage, meter, rejections, record
        self._rounds: Counter[str] = Counter()
        self._drift: tuple[float, float] | None = None  # (before, after) of the latest round that measured it
        self._lock = threading.Lock()

    def on_round(self, report: RoundReport) -> None:
        with self._lock:
            self._rounds["averaged" if report.ok else "failed"] += 1
            if report.drift_before is not None and report.drift_after is not None:  # None: it averaged nothing
                self._drift = (report.drift_before, report.drift_after)

    def _values(self) -> dict[str, Values]:
        stage, totals, record = self.stage, self._meter.totals(), self._record()
        with self._lock:
            rounds = {(stage, outcome): self._rounds[outcome] for outcome in ("averaged", "failed")}
            drift = self._drift
        return {
            REQUESTS.name: {(stage, "forward"): totals.forward, (stage, "backward"): totals.backward},
            REFUSED.name: {(stage, reason): count for reason, count in self._rejections.totals().items()},
            BYTES.name: {(stage, "sent"): totals.bytes_out, (stage, "received"): totals.bytes_in},
            SPARTA_ROUNDS.name: rounds,
            **({} if drift is None else {SPARTA_DRIFT.name: {(stage, "before"): drift[0], (stage, "after"): drift[1]}}),
            PHASE.name: {(stage, name): float(code == record.sync_phase) for code, name in NAMES.items()},
            EPOCH.name: {stage: record.epoch},
            HEALTHY.name: {stage: float(record.healthy)},
        }


def watch_worker(node: WorkerNode) -> WorkerCollector:
    """The node's collector, counting its SPARTA rounds from now on."""
    collector = WorkerCollector(node.options.stage, node.meter, node.rejections, node.record)
    node.add_round_hook(collector.on_round)
    return collector
