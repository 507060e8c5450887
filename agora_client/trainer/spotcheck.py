"""Spot checks: a trainer re-runs a sample of its stage requests on a second worker of the stage and compares.

A worker could answer with random tensors of the right shape, cheaper than computing them. For a
``fraction`` of requests (forward and backward alike) the trainer sends the same request to another
worker of the stage and compares the two answers by relative L2 distance (``relative_distance``).
Honest replicas are not equal (SPARTA keeps them close), so each stage and kind of request has its own
tolerance, calibrated from the distances between answers known to be honest (agora_client/trainer/
calibration.py says how): while a stage has too few of them, and on a ``calibration_share`` of later
checks, the trainer also asks a third worker and learns from the three answers.

Only a ``verifiable`` stage and kind is judged. There, two answers within the tolerance agree. When they
disagree, a third worker (the calibration's, or a referee asked now) settles it: if its answer agrees
with exactly one of the two, and the other's is farther from it than an honest replica's can be
(calibration.strike_distance), the other worker takes a strike; the microbatch goes on with the referee's
answer whenever the first one is the odd one out. ``strikes`` strikes ban a worker from this trainer's
routing and name it through ``on_ban`` (the trainer publishes a verdict so the monitor withholds its
compute points). Without a third worker, when the referee agrees with neither, or when the odd answer is
no farther than drift can take an honest one, a disagreement stays unresolved: it is counted, and nobody is
struck. A stage and kind still ``calibrating``, or
``unverifiable`` (honest replicas drift about as far apart as random answers, as the tiny preset's head
does after a few steps), is checked and calibrated but strikes no one.

Where a stage and kind is not judged, the checks' answers are witnesses for the escrow of the work served there
(``receipts.escrow``, agora_client/trainer/escrow.py), judged once the stage is verifiable.

A backward sent twice (or three times) adds that microbatch's gradient to the other replicas as well: a
small bias, paid only on the checked fraction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agora_client.config import SpotCheckConfig
from agora_client.discovery.progress_records import CheckStanding, StageSpotChecks
from agora_client.discovery.roster import WorkerRecord
from agora_client.trainer.balancer import Kind, Router, WorkerKey
from agora_client.trainer.calibration import Calibration, confirmed_distances, strike_distance
from agora_client.trainer.escrow import Witnessed
from agora_client.trainer.receipts import ReceiptBook
from agora_client.trainer.rpc import StageClient

KINDS: tuple[Kind, Kind] = ("forward", "backward")
Answer = tuple[WorkerRecord, list[torch.Tensor]]


def relative_distance(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> float:
    """Largest ||a - b|| / min(||a||, ||b||) over the outputs; inf when shapes differ or a value is not finite.

    The smaller norm, not the larger: an answer independent of the truth is then at least sqrt(2) away
    whatever its scale (zeros or small noise would be 1.0 away from anything with the larger norm)."""
    if len(first) != len(second):
        return math.inf
    worst = 0.0
    for a, b in zip(first, second, strict=True):
        if a.shape != b.shape:
            return math.inf
        a, b = a.detach().double(), b.detach().double()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            return math.inf
        difference, scale = float((a - b).norm()), min(float(a.norm()), float(b.norm()))
        if difference > 0:
            worst = max(worst, difference / scale if scale > 0 else math.inf)
    return worst


@dataclass(frozen=True)
class Finding:
    """A worker banned for disagreeing with its stage's majority."""

    stage: str
    worker: WorkerRecord
    checks: int
    disagreements: int


@dataclass(frozen=True)
class Strike:
    """A worker whose answer was farther from the referee's than an honest replica's can be."""

    stage: str
    kind: Kind
    worker: WorkerRecord
    distance: float  # from the referee's answer
    pair_distance: float  # between the referee's answer and the one it agreed with
    tolerance: float
    strikes: int  # this worker's, this one included

    def describe(self, margin: float, ban_at: int) -> str:
        return (
            f"strike {self.strikes} of {ban_at} for {self.worker.uid} on {self.stage} {self.kind}: its answer was "
            f"{self.distance:.3f} from the referee's (tolerance {self.tolerance:.3f}, strikes from "
            f"{strike_distance(self.tolerance, margin):.3f}; the referee and the other answer "
            f"{self.pair_distance:.3f} apart)"
        )


@dataclass
class SpotCheckStats:
    checks: int = 0  # requests re-run on a second worker
    calibrations: int = 0  # checks that also asked a third worker, to measure how far honest replicas drift
    unjudged: int = 0  # checks on a stage and kind still calibrating, or unverifiable: nobody is judged
    agreed: int = 0
    resolved: int = 0  # disagreements a referee settled
    unresolved: int = 0  # disagreements without a third worker, or whose referee agreed with neither
    strikes: int = 0
    bans: int = 0  # last: scripts read the log line's end


@dataclass
class _StageCounts:
    checks: int = 0
    strikes: int = 0
    bans: int = 0


class SpotChecker:
    """Called by the pipeline after every successful stage request; thread-safe."""

    def __init__(
        self,
        config: SpotCheckConfig,
        router: Router,
        clients: dict[str, StageClient],
        *,
        on_ban: Callable[[Finding], None] = lambda finding: None,
        on_strike: Callable[[Strike], None] = lambda strike: None,
        on_standing: Callable[[str, Kind, CheckStanding], None] = lambda stage, kind, standing: None,
        receipts: ReceiptBook | None = None,
        rng: random.Random | None = None,
    ):
        self.config, self.router, self.clients, self.on_ban, self.on_standing = (
            config,
            router,
            clients,
            on_ban,
            on_standing,
        )
        self.on_strike = on_strike
        self.receipts = receipts  # a re-run costs the worker as much as any request: it is receipted too
        self.escrow = receipts.escrow if receipts is not None else None
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._checks: dict[WorkerKey, int] = {}
        self._strikes: dict[WorkerKey, int] = {}
        self._banned: set[WorkerKey] = set()
        self._calibrations = {(stage, kind): Calibration(config) for stage in clients for kind in KINDS}
        self._standings = {key: calibration.standing() for key, calibration in self._calibrations.items()}
        self._stages = {stage: _StageCounts() for stage in clients}
        self.stats = SpotCheckStats()

    def report(self) -> dict[str, StageSpotChecks]:
        """Per stage: its checks, strikes and bans, and where its forward and backward checks stand."""
        with self._lock:
            return {
                stage: StageSpotChecks(
                    checks=counts.checks,
                    strikes=counts.strikes,
                    bans=counts.bans,
                    **{kind: self._standings[stage, kind] for kind in KINDS},
                )
                for stage, counts in self._stages.items()
            }

    def review(
        self,
        stage: str,
        kind: Kind,
        units: float,
        worker: WorkerRecord,
        inputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        outputs: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The answer the microbatch should go on with: ``outputs``, or the referee's if ``worker`` was caught."""
        with self._lock:
            sampled = self._rng.random() < self.config.fraction
            calibrating = sampled and self._calibrations[stage, kind].wants_third_answer(self._rng)
        if not sampled:
            return outputs
        rerun = functools.partial(self._rerun, stage, kind, units, inputs, grad_outputs)
        second = rerun({worker.key})
        if second is None:
            return outputs  # no other worker free, or it failed: nothing to compare against
        first: Answer = (worker, outputs)
        third = (
            rerun({worker.key, second[0].key}) if calibrating or self._disagree(stage, kind, first, second) else None
        )
        if third is not None:
            self._calibrate(stage, kind, (first, second, third))
        answers = [first, second] if third is None else [first, second, third]
        if self.escrow is not None and self.escrow.holding(stage, kind, [worker.peer_id for worker, _ in answers]):
            self.escrow.witness(stage, kind, _witnessed(answers))
        return self._judge(stage, kind, first, second, third, calibrated=calibrating and third is not None)

    def _disagree(self, stage: str, kind: Kind, first: Answer, second: Answer) -> bool:
        """Whether two answers disagree on a stage and kind that is judged: a referee is then asked."""
        with self._lock:
            standing = self._standings[stage, kind]
        return standing.state == "verifiable" and relative_distance(first[1], second[1]) > standing.tolerance

    def _judge(
        self, stage: str, kind: Kind, first: Answer, second: Answer, third: Answer | None, calibrated: bool
    ) -> list[torch.Tensor]:
        with self._lock:
            standing = self._standings[stage, kind]
        compared = (first[0], second[0]) if third is None else (first[0], second[0], third[0])
        if standing.state != "verifiable":
            self._count(stage, "unjudged", compared, calibrated)
            return first[1]
        if relative_distance(first[1], second[1]) <= standing.tolerance:
            self._count(stage, "agreed", compared, calibrated)
            return first[1]
        agrees = (
            [] if third is None else [relative_distance(a[1], third[1]) <= standing.tolerance for a in (first, second)]
        )
        if agrees.count(True) != 1:  # no referee, or it agrees with both or neither: nobody can be blamed
            self._count(stage, "unresolved", compared, calibrated)
            return first[1]
        odd, kept = (second, first) if agrees[0] else (first, second)
        going_on = first[1] if agrees[0] else third[1]
        distance = relative_distance(odd[1], third[1])
        if distance <= strike_distance(standing.tolerance, self.config.margin):
            self._count(stage, "unresolved", compared, calibrated)  # as far as an honest replica may drift
            return going_on
        self._count(stage, "resolved", compared, calibrated)
        self._strike(Strike(stage, kind, odd[0], distance, relative_distance(kept[1], third[1]), standing.tolerance, 0))
        return going_on

    def _calibrate(self, stage: str, kind: Kind, answers: tuple[Answer, Answer, Answer]) -> None:
        """Learn the honest distances among three answers to one request; say so if the stage's standing changed."""
        a, b, c = (answer for _, answer in answers)
        honest = confirmed_distances(
            [relative_distance(a, b), relative_distance(a, c), relative_distance(b, c)], self.config.margin
        )
        with self._lock:
            calibration = self._calibrations[stage, kind]
            calibration.add(honest)
            before, after = self._standings[stage, kind], calibration.standing()
            self._standings[stage, kind] = after
        if self.escrow is not None:
            self.escrow.stand(stage, kind, after)
        if after.state != before.state:
            self.on_standing(stage, kind, after)

    def _rerun(
        self,
        stage: str,
        kind: Kind,
        units: float,
        inputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        exclude: set[WorkerKey],
    ) -> Answer | None:
        balancer, client = self.router[stage], self.clients[stage]
        lease = balancer.choose(kind, units, exclude=exclude)
        if lease is None:
            return None
        try:
            if kind == "forward":
                answer = client.forward(lease.worker, inputs)
            else:
                answer = client.backward(lease.worker, inputs, grad_outputs)
        except Exception as error:  # a check that fails checks nothing; the balancer learns of the failure
            balancer.report_failure(lease, error)
            return None
        balancer.report_success(lease)
        if self.receipts is not None:
            self.receipts.count(stage, kind, lease.worker.peer_id, inputs)
        return lease.worker, answer

    def _count(self, stage: str, outcome: str, workers: Sequence[WorkerRecord], calibrated: bool) -> None:
        with self._lock:
            self.stats.checks += 1
            self.stats.calibrations += calibrated
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            self._stages[stage].checks += 1
            for record in workers:
                self._checks[record.key] = self._checks.get(record.key, 0) + 1

    def _strike(self, strike: Strike) -> None:
        stage, worker = strike.stage, strike.worker
        with self._lock:
            self.stats.strikes += 1
            self._stages[stage].strikes += 1
            strikes = self._strikes[worker.key] = self._strikes.get(worker.key, 0) + 1
            banning = strikes >= self.config.strikes and worker.key not in self._banned
            if banning:
                self._banned.add(worker.key)
                self.stats.bans += 1
                self._stages[stage].bans += 1
                finding = Finding(stage, worker, self._checks[worker.key], strikes)
        self.on_strike(dataclasses.replace(strike, strikes=strikes))
        if banning:
            self.router[stage].ban(worker.key, self.config.ban_seconds)
            self.on_ban(finding)


def _witnessed(answers: Sequence[Answer]) -> Witnessed:
    """Who answered one check and how far apart each pair of answers was."""
    return Witnessed(
        tuple(worker.peer_id for worker, _ in answers),
        {
            (i, j): relative_distance(answers[i][1], answers[j][1])
            for i in range(len(answers))
            for j in range(i + 1, len(answers))
        },
    )
