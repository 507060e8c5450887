"""Choose which worker of a stage takes the next request: shortest expected delay first.

A request goes to the worker that would finish it first: (requests in flight there + 1) x its learned
seconds per unit of work, a per-worker, per-kind moving average of measured round trips. A worker three
times slower thus gets a request only while the fast one has three or more in flight: it adds capacity
when the fast one is saturated and never adds its latency to a pipeline the fast one could carry alone
(what equal-busy-time sharing would do). Ties go to the least accumulated virtual runtime (the estimated
seconds of work routed so far), so equal workers take turns and newcomers enter at the back.

An average only changes when its worker serves, so one slow answer (a busy moment) could keep a worker
out for good. An average older than ``probe_after_s`` of a worker with nothing in flight therefore counts
as no worse than the stage's best: the worker gets one request, and that fresh measurement replaces the
old average. A worker that really is slow pays for one probe per period.

Thread-safe: a pipeline loop may call everything from several microbatch threads at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from agora_client.discovery.roster import WorkerRecord
from agora_client.trainer.errors import ErrorClass, classify

Kind = Literal["forward", "backward"]
SAME_DELAY = 1.1  # expected delays within 10 % of the shortest are a tie
WorkerKey = tuple[str, str]  # (expert uid, peer id): a restarted worker with a new peer id is a new worker


@dataclass(frozen=True)
class Lease:
    """One request handed to one worker; give it back with report_success or report_failure."""

    worker: WorkerRecord
    kind: Kind
    units: float
    charged: float  # estimated seconds added to the worker's runtime up front
    started_at: float
    _slot: _Worker = field(repr=False, compare=False)  # the balancer's entry it was charged to

    @property
    def key(self) -> WorkerKey:
        return self.worker.key


class FailureVerdict(NamedTuple):
    error_class: ErrorClass
    banned: bool  # this failure banned the worker


@dataclass
class StageStats:
    stage: str
    workers: int  # in the roster
    ready: int  # eligible for requests now
    syncing: int  # sync phase 1, skipped
    banned: int
    in_flight: int
    done: int  # requests that succeeded
    retries: int  # failures worth retrying (transient or unreachable)
    rejected: int  # failures not worth retrying (bad request, our bug)
    bans: int  # times a worker was banned
    served: dict[str, int] = field(default_factory=dict)  # uid -> successful requests

    def summary(self) -> str:
        return (
            f"{self.stage}: {self.ready}/{self.workers} ready, {self.syncing} syncing, {self.banned} banned; "
            f"{self.done} done, {self.retries} retries, {self.rejected} rejected, {self.bans} bans"
        )


@dataclass
class _Worker:
    record: WorkerRecord
    vruntime: float = 0.0
    eligible: bool = False  # may take requests now (not banned, not in sync phase 1)
    per_unit: dict[str, float] = field(default_factory=dict)  # kind -> EMA seconds per unit of work
    measured_at: dict[str, float] = field(default_factory=dict)  # kind -> clock of its last measurement
    banned_until: float | None = None
    transient_streak: int = 0  # consecutive transient failures without a success
    in_flight: int = 0


class StageBalancer:
    """Least-loaded routing among the workers of one stage, with short bans for unreachable ones."""

    def __init__(
        self,
        stage: str,
        *,
        ban_seconds: float = 30.0,
        ema_alpha: float = 0.3,
        default_estimate_s: float = 1.0,
        max_transient_streak: int = 3,
        probe_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (
            ban_seconds < 0
            or not 0 < ema_alpha <= 1
            or default_estimate_s <= 0
            or max_transient_streak < 1
            or probe_after_s <= 0
        ):
            raise ValueError(
                "StageBalancer needs ban_seconds >= 0, 0 < ema_alpha <= 1, default_estimate_s > 0, "
                "max_transient_streak >= 1 and probe_after_s > 0"
            )
        self.stage = stage
        self.ban_seconds = ban_seconds
        self._alpha = ema_alpha
        self._default_estimate = default_estimate_s
        self._max_transient_streak = max_transient_streak
        self._probe_after = probe_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[WorkerKey, _Worker] = {}
        self._done = self._retries = self._rejected = self._bans = 0
        self._served: dict[str, int] = {}

    # roster ---------------------------------------------------------------------------------------

    def update_roster(self, records: Iterable[WorkerRecord] | Mapping[str, WorkerRecord]) -> None:
        """Replace the set of live workers with this one (the current DHT view of the stage)."""
        records = list(records.values()) if isinstance(records, Mapping) else list(records)
        for record in records:
            if record.stage != self.stage:
                raise ValueError(f"worker {record.uid} belongs to stage {record.stage!r}, not {self.stage!r}")
        with self._lock:
            now = self._clock()
            latest = {record.key: record for record in records}
            for key in [key for key in self._workers if key not in latest]:
                del self._workers[key]  # gone, banned or not: forgotten
            for key, record in latest.items():
                worker = self._workers.setdefault(key, _Worker(record))
                worker.record = record
            self._refresh_membership(now)

    def ban(self, key: WorkerKey, seconds: float | None = None) -> None:
        """Keep a worker out of routing for ``seconds`` (default ban_seconds)."""
        with self._lock:
            worker = self._workers.get(key)
            if worker is not None:
                self._ban(worker, self._clock(), self.ban_seconds if seconds is None else seconds)

    # routing --------------------------------------------------------------------------------------

    def choose(
        self,
        kind: Kind = "forward",
        units: float = 1.0,
        *,
        exclude: Collection[WorkerKey] = (),
        prefer: WorkerKey | None = None,
    ) -> Lease | None:
        """Hand the request to ``prefer`` if it is eligible, else to the least-loaded eligible worker.

        ``units`` is the size of the work (tokens, say); estimates scale with it. None when no
        worker of the stage is eligible right now.
        """
        with self._lock:
            now = self._clock()
            self._refresh_membership(now)
            worker = self._workers.get(prefer) if prefer is not None else None
            if worker is None or not worker.eligible or prefer in exclude:
                worker = self._select(exclude, kind)
            if worker is None:
                return None
            charge = self._estimate(worker, kind) * units
            worker.vruntime += charge
            worker.in_flight += 1
            return Lease(worker.record, kind, units, charge, now, worker)

    def report_success(self, lease: Lease, duration_s: float | None = None) -> None:
        """Learn from a completed request; ``duration_s`` defaults to the time since it was chosen."""
        with self._lock:
            now = self._clock()
            duration = now - lease.started_at if duration_s is None else duration_s
            self._done += 1
            self._served[lease.worker.uid] = self._served.get(lease.worker.uid, 0) + 1
            worker = self._live(lease)
            if worker is None:
                return
            worker.in_flight -= 1
            worker.transient_streak = 0
            per_unit = max(duration, 0.0) / max(lease.units, 1e-9)
            previous = worker.per_unit.get(lease.kind)
            if previous is not None and not self._stale(worker, lease.kind, lease.started_at):
                per_unit = previous + self._alpha * (per_unit - previous)
            worker.per_unit[lease.kind] = per_unit
            worker.measured_at[lease.kind] = now
            if worker.eligible:
                worker.vruntime += worker.per_unit[lease.kind] * lease.units - lease.charged

    def report_failure(self, lease: Lease, error: BaseException) -> FailureVerdict:
        """Classify the error; ban the worker if it is unreachable or keeps timing out."""
        error_class = classify(error)
        with self._lock:
            if error_class is ErrorClass.FATAL:
                self._rejected += 1
            else:
                self._retries += 1
            worker = self._live(lease)
            if worker is None:
                return FailureVerdict(error_class, False)
            worker.in_flight -= 1
            if error_class is ErrorClass.RETRY_SAME:
                worker.transient_streak += 1
                if worker.transient_streak >= self._max_transient_streak:
                    error_class = ErrorClass.RETRY_OTHER  # "transient" every time: treat it as unreachable
            if error_class is ErrorClass.RETRY_OTHER and worker.banned_until is None:
                self._ban(worker, self._clock(), self.ban_seconds)
                return FailureVerdict(error_class, True)
            return FailureVerdict(error_class, False)

    # observation ----------------------------------------------------------------------------------

    def is_empty(self) -> bool:
        """No worker of the stage can take a request right now."""
        with self._lock:
            self._refresh_membership(self._clock())
            return not any(worker.eligible for worker in self._workers.values())

    def estimate(self, key: WorkerKey, kind: Kind) -> float | None:
        """Learned seconds per unit of work for a worker, None before its first measurement."""
        with self._lock:
            worker = self._workers.get(key)
            return None if worker is None else worker.per_unit.get(kind)

    def stats(self) -> StageStats:
        with self._lock:
            self._refresh_membership(self._clock())
            workers = list(self._workers.values())
            return StageStats(
                stage=self.stage,
                workers=len(workers),
                ready=sum(worker.eligible for worker in workers),
                syncing=sum(not worker.record.routable for worker in workers),
                banned=sum(worker.banned_until is not None for worker in workers),
                in_flight=sum(worker.in_flight for worker in workers),
                done=self._done,
                retries=self._retries,
                rejected=self._rejected,
                bans=self._bans,
                served=dict(self._served),
            )

    # internals (call with the lock held) ----------------------------------------------------------

    def _select(self, exclude: Collection[WorkerKey], kind: Kind) -> _Worker | None:
        """The eligible worker expected to finish one more request first (a stage has a handful of workers)."""
        delays = {
            key: (w.in_flight + 1) * self._estimate(w, kind)
            for key, w in self._workers.items()
            if w.eligible and key not in exclude
        }
        if not delays:
            return None
        shortest = min(delays.values())
        # delays within the noise of the estimates count as equal: then the worker with less work so far goes
        return min(
            (self._workers[key] for key, delay in delays.items() if delay <= shortest * SAME_DELAY),
            key=lambda w: w.vruntime,
        )

    def _refresh_membership(self, now: float) -> None:
        """Lift expired bans; newly eligible workers enter at the back of the turn order."""
        back = max((w.vruntime for w in self._workers.values() if w.eligible), default=0.0)
        for worker in self._workers.values():
            if worker.banned_until is not None and worker.banned_until <= now:
                worker.banned_until = None
                worker.transient_streak = 0
            eligible = worker.banned_until is None and worker.record.routable  # phase-1 workers are skipped
            if eligible and not worker.eligible:
                worker.vruntime = back  # newcomers enter at the back: they cannot take over proven workers
            worker.eligible = eligible

    def _ban(self, worker: _Worker, now: float, seconds: float) -> None:
        worker.banned_until = now + seconds
        worker.eligible = False
        self._bans += 1

    def _live(self, lease: Lease) -> _Worker | None:
        """The worker a lease went to, unless it has left the roster since (even if it came back)."""
        worker = self._workers.get(lease.key)
        return worker if worker is lease._slot else None

    def _estimate(self, worker: _Worker, kind: Kind) -> float:
        """Seconds per unit: its own average (at most the stage's best once stale), else the stage's average
        for this kind, else the default."""
        known = [other.per_unit[kind] for other in self._workers.values() if kind in other.per_unit]
        own = worker.per_unit.get(kind)
        if own is None:
            return sum(known) / len(known) if known else self._default_estimate
        if worker.in_flight == 0 and self._stale(worker, kind, self._clock()):
            return min(known)  # worth a probe: the old average may describe a moment long gone
        return own

    def _stale(self, worker: _Worker, kind: Kind, at: float) -> bool:
        """Its average for ``kind`` was last measured probe_after_s or more before ``at``."""
        measured = worker.measured_at.get(kind)
        return measured is not None and at - measured >= self._probe_after


class RoundRobinBalancer(StageBalancer):
    """Baseline for bench/routing.py: same roster, bans and stats, but workers take turns regardless of load."""

    def __init__(self, stage: str, **kwargs: Any) -> None:
        super().__init__(stage, **kwargs)
        self._turn = 0

    def _select(self, exclude: Collection[WorkerKey], kind: Kind) -> _Worker | None:
        ready = sorted(key for key, w in self._workers.items() if w.eligible and key not in exclude)
        if not ready:
            return None
        self._turn += 1
        return self._workers[ready[self._turn % len(ready)]]


class Router:
    """One balancer per stage, in pipeline order."""

    def __init__(self, stages: Iterable[str], make_balancer: Callable[[str], StageBalancer] = StageBalancer) -> None:
        self.balancers: dict[str, StageBalancer] = {stage: make_balancer(stage) for stage in stages}
        if not self.balancers:
            raise ValueError("Router needs at least one stage")
        self._lock = threading.Lock()
        self._window_base: dict[str, StageStats] = {}

    def __getitem__(self, stage: str) -> StageBalancer:
        return self.balancers[stage]

    def update_roster(self, records: Iterable[WorkerRecord]) -> int:
        """Give each stage its workers from one full listing; returns how many records named no known stage."""
        by_stage: dict[str, list[WorkerRecord]] = {stage: [] for stage in self.balancers}
        unknown = 0
        for record in records:
            if record.stage in by_stage:
                by_stage[record.stage].append(record)
            else:
                unknown += 1
        for stage, stage_records in by_stage.items():
            self.balancers[stage].update_roster(stage_records)
        return unknown

    def empty_stages(self) -> list[str]:
        """Stages where no worker can take a request right now (pipeline order)."""
        return [stage for stage, balancer in self.balancers.items() if balancer.is_empty()]

    def all_stages_ready(self) -> bool:
        return not self.empty_stages()

    def stats(self) -> dict[str, StageStats]:
        return {stage: balancer.stats() for stage, balancer in self.balancers.items()}

    def window_stats(self) -> dict[str, StageStats]:
        """Current worker counts, with done/retries/rejected/bans/served counted since the previous call."""
        with self._lock:
            current = self.stats()
            window = {}
            for stage, now in current.items():
                base = self._window_base.get(stage)
                if base is None:
                    window[stage] = now
                    continue
                window[stage] = StageStats(
                    stage=stage,
                    workers=now.workers,
                    ready=now.ready,
                    syncing=now.syncing,
                    banned=now.banned,
                    in_flight=now.in_flight,
                    done=now.done - base.done,
                    retries=now.retries - base.retries,
                    rejected=now.rejected - base.rejected,
                    bans=now.bans - base.bans,
                    served={uid: n - base.served.get(uid, 0) for uid, n in now.served.items()},
                )
            self._window_base = current
            return window
