"""Held-out evaluation: every ``eval.every_s`` the trainer sends its fixed held-out sample through the pipeline,
forward passes only, in a thread of its own beside training; the result goes into its reports and records."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from agora_client.trainer.pipeline import Pipeline, RequestFailed


@dataclass(frozen=True)
class EvalResult:
    loss: float
    sequences: int
    tokens: int
    ts: float  # wall time the evaluation finished


class HeldOutEvaluation:
    def __init__(
        self,
        pipeline: Pipeline,
        sample: torch.Tensor,
        microbatch_size: int,
        every_s: float,
        on_failure: Callable[[str], None],
    ):
        self.pipeline, self.sample, self.microbatch_size, self.every_s = pipeline, sample, microbatch_size, every_s
        self.on_failure = on_failure
        self.latest: EvalResult | None = None
        self._finished: list[EvalResult] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next_at = time.monotonic()  # the first evaluation is the baseline, before any training

    def start_if_due(self) -> None:
        if time.monotonic() < self._next_at or (self._thread is not None and self._thread.is_alive()):
            return
        self._next_at = time.monotonic() + self.every_s
        self._thread = threading.Thread(target=self._evaluate, name="held-out-eval", daemon=True)
        self._thread.start()

    def take_finished(self) -> list[EvalResult]:
        """Evaluations finished since the last call (to print once each)."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def _evaluate(self) -> None:
        total, count = 0.0, 0
        try:
            for batch in self.sample.split(self.microbatch_size):
                total += self.pipeline.eval_microbatch(batch) * len(batch)
                count += len(batch)
        except RequestFailed as error:
            if not self.pipeline.stop.is_set():
                self.on_failure(f"held-out evaluation dropped: {error}")
            return
        result = EvalResult(total / count, count, count * (self.sample.shape[1] - 1), time.time())
        with self._lock:
            self.latest = result
            self._finished.append(result)
