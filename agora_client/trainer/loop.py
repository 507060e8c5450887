"""The trainer's loop: keep ``--inflight`` microbatches going through the pipeline, report progress, evaluate on
held-out data and save the data position, until stopped or ``--max-microbatches`` are done.

With spot checks, each report also says per stage where its checks stand and the stage's replica parameter drift
(trainer/replica_drift.py), so that a calibrated tolerance reads beside how far the stage's parameters are apart."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterator, Mapping

import torch

from agora_client.data.sources import DataError
from agora_client.trainer.balancer import Router, StageStats
from agora_client.trainer.evaluation import HeldOutEvaluation
from agora_client.trainer.pipeline import Pipeline, RequestFailed
from agora_client.trainer.progress import ProgressPublisher
from agora_client.trainer.records import TrainerRecords
from agora_client.trainer.rpc import TrafficCounter

Say = Callable[[str, str], None]
RATE_WINDOW_S = 1.0  # a report right after another (all in flight finished at once) is too short to rate tokens over


class TrainingLoop:
    def __init__(
        self,
        pipeline: Pipeline,
        batches: Iterator[torch.Tensor],
        router: Router,
        traffic: TrafficCounter,
        progress: ProgressPublisher,
        evaluation: HeldOutEvaluation,
        records: TrainerRecords | None,
        say: Say,
        replica_drifts: Callable[[], Mapping[str, float | None]],
    ):
        self.pipeline, self.batches, self.router, self.traffic = pipeline, batches, router, traffic
        self.progress, self.evaluation, self.records, self.say = progress, evaluation, records, say
        self.replica_drifts = replica_drifts  # each stage's, read at every report with spot checks
        self.done, self.losses, self.tokens = 0, [], 0  # tokens: trained since rate_since
        self.dispatched = 0  # microbatches handed to the pipeline: the data position is just after them
        self.last_report = self.rate_since = time.monotonic()
        self.tokens_per_s = 0.0

    @property
    def stop(self) -> threading.Event:
        return self.pipeline.stop

    def run(self, inflight: int, max_microbatches: int, report_every: float) -> int:
        """Train until stopped (or ``max_microbatches``); the microbatches done. DataError on a bad record."""
        with ThreadPoolExecutor(inflight, thread_name_prefix="microbatch") as pool:
            pending: dict[Future, int] = {}
            while not self.stop.is_set():
                self.evaluation.start_if_due()
                while len(pending) < inflight and not (
                    max_microbatches and self.done + len(pending) >= max_microbatches
                ):
                    batch = self._next_batch()
                    pending[pool.submit(self.pipeline.train_microbatch, batch)] = batch[:, :-1].numel()
                if not pending:
                    break
                finished, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in finished:
                    self._finish(future, pending.pop(future))
                self._report_evaluations()
                if self.records is not None:
                    self.records.save_if_due(self.dispatched, self._eval_loss())
                if time.monotonic() - self.last_report >= report_every or (self.losses and not pending):
                    self._report()  # also while nothing finishes: the roster and bans are what matter then
            self.stop.set()
        if self.records is not None:
            self.records.close(self.dispatched, self._eval_loss())
        return self.done

    def _next_batch(self) -> torch.Tensor:
        try:
            batch = next(self.batches)
        except DataError:
            self.stop.set()  # let the microbatches in flight finish, then report the error
            raise
        self.dispatched += 1
        return batch

    def _finish(self, future: Future, batch_tokens: int) -> None:
        try:
            self.losses.append(future.result())
            self.tokens += batch_tokens
            self.done += 1
        except RequestFailed as error:
            if not self.stop.is_set():
                self.say("WARNING", f"microbatch dropped: {error}")

    def _eval_loss(self) -> float | None:
        latest = self.evaluation.latest
        return None if latest is None else latest.loss

    def _report_evaluations(self) -> None:
        for result in self.evaluation.take_finished():
            self.say("EVAL", f"loss={result.loss:.4f} sequences={result.sequences} tokens={result.tokens}")

    def _report(self) -> None:
        now = time.monotonic()
        if now - self.rate_since >= RATE_WINDOW_S:
            self.tokens_per_s, self.tokens, self.rate_since = self.tokens / (now - self.rate_since), 0, now
        roster = "; ".join(_stage_summary(stats) for stats in self.router.window_stats().values())
        mean_loss = sum(self.losses) / len(self.losses) if self.losses else None
        loss = "n/a" if mean_loss is None else f"{mean_loss:.4f}"
        self.say("PROGRESS", f"microbatches={self.done} loss={loss} tokens_per_s={self.tokens_per_s:.1f} | {roster}")
        self.say("TRAFFIC", json.dumps(self.traffic.per_token()))  # serialized bytes per token, per stage and kind
        spot_checks = self.pipeline.spot_checks
        stages = {} if spot_checks is None else spot_checks.report()
        try:  # contributors draw the swarm's loss from these records
            latest = self.evaluation.latest
            evaluated = {} if latest is None else {"eval_loss": latest.loss, "eval_at": latest.ts}
            self.progress.publish(self.done, mean_loss, self.tokens_per_s, **evaluated, spot_checks=stages)
        except Exception as error:  # a DHT hiccup must not stop training
            self.say("WARNING", f"could not publish the progress record: {error}")
        if spot_checks is not None:
            self.say("SPOTCHECK", " ".join(f"{name}={value}" for name, value in vars(spot_checks.stats).items()))
            drifts = self.replica_drifts()
            reports = {
                stage: {**report.model_dump(), "parameter_drift": drifts.get(stage)} for stage, report in stages.items()
            }
            self.say("SPOTCHECK", "stages " + json.dumps(reports))
        self.losses, self.last_report = [], time.monotonic()


def _stage_summary(stats: StageStats) -> str:
    """The balancer's summary plus the requests each worker served in the window."""
    served = " ".join(f"{uid}={count}" for uid, count in sorted(stats.served.items()))
    return f"{stats.summary()}, served [{served}]"
