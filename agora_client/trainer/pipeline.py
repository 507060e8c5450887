"""One microbatch through the remote pipeline: head -> bodies -> tail, then gradients back.

The trainer holds no parameters. Forward sends each stage's input to the least-loaded worker of
that stage; backward resends the same input with the gradient of the stage's output, preferring
the worker that ran the forward. When that worker is gone another worker of the stage runs the
stateless backward: it recomputes the forward from the resent input with its own weights, so the
gradient is that of a same-stage replica (close, since SPARTA keeps replicas in agreement), not of
the exact weights that produced the activations.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import torch

from agora_client.trainer.balancer import FailureVerdict, Kind, Lease, Router, WorkerKey
from agora_client.trainer.errors import DEFAULT_RETRY, ErrorClass, RetryPolicy
from agora_client.trainer.receipts import ReceiptBook
from agora_client.trainer.rpc import StageClient
from agora_client.trainer.spotcheck import SpotChecker

STALL_POLL_SECONDS = 1.0


class RequestFailed(RuntimeError):
    """A request that cannot succeed by retrying (rejected as malformed, or out of attempts)."""


class NonFiniteLoss(RequestFailed):
    """The tail returned a NaN or infinite loss: the microbatch is dropped before any backward."""


class StallNotice:
    """Says once that a stage has no reachable worker, and once that it is back."""

    def __init__(self, say: Callable[[str], None]):
        self._say, self._stalled, self._lock = say, set(), threading.Lock()

    def stalled(self, stage: str) -> None:
        with self._lock:
            if stage not in self._stalled:
                self._stalled.add(stage)
                self._say(f"stage {stage} has no reachable worker: the pipeline waits until one returns")

    def resumed(self, stage: str) -> None:
        with self._lock:
            if stage in self._stalled:
                self._stalled.discard(stage)
                self._say(f"stage {stage} has a worker again: resuming")


class Pipeline:
    def __init__(
        self,
        stages: Sequence[str],
        clients: dict[str, StageClient],
        router: Router,
        stall: StallNotice,
        *,
        policy: RetryPolicy = DEFAULT_RETRY,
        stop: threading.Event | None = None,
        on_failure: Callable[[str], None] = lambda message: None,
        spot_checks: SpotChecker | None = None,
        receipts: ReceiptBook | None = None,
    ):
        self.stages, self.clients, self.router, self.stall = list(stages), clients, router, stall
        self.policy = policy
        self.stop = stop or threading.Event()
        self.on_failure = on_failure  # one line per failed request: which worker, which kind, what happens next
        self.spot_checks = spot_checks
        self.receipts = receipts  # counts what each worker served, for the monitor to check claims against

    def train_microbatch(self, batch: torch.Tensor) -> float:
        """Forward and backward one [B, T+1] token batch; returns its mean loss."""
        losses, trace = self._forward(batch)
        # Workers average gradients over the samples they accumulated, so each sample's loss gets weight 1.
        grad: torch.Tensor = torch.ones_like(losses)
        units = float(batch[:, :-1].numel())
        for stage, worker, inputs in reversed(trace):
            _, grads = self._call(stage, "backward", units, inputs, grad_outputs=(grad,), prefer=worker)
            grad = grads[0]
        return float(losses.mean())

    def eval_microbatch(self, batch: torch.Tensor) -> float:
        """Forward passes only (held-out evaluation: no worker accumulates a gradient); returns the mean loss."""
        losses, _ = self._forward(batch)
        return float(losses.mean())

    def _forward(
        self, batch: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[str, WorkerKey, tuple[torch.Tensor, ...]]]]:
        """The per-sample losses of a [B, T+1] batch, and each stage's (stage, worker, inputs) for the backward."""
        tokens, labels = batch[:, :-1], batch[:, 1:]
        units = float(tokens.numel())
        boundary: torch.Tensor | None = None
        trace: list[tuple[str, WorkerKey, tuple[torch.Tensor, ...]]] = []
        for stage in self.stages:
            if stage == "head":
                inputs = (tokens,)
            elif stage == "tail":
                inputs = (boundary, tokens, labels)
            else:
                inputs = (boundary, tokens)
            worker, outputs = self._call(stage, "forward", units, inputs)
            trace.append((stage, worker, inputs))
            boundary = outputs[0]
        if not bool(torch.isfinite(boundary).all()):
            tail_uid = trace[-1][1][0]
            raise NonFiniteLoss(
                f"the loss from {tail_uid} is not finite; the microbatch is dropped without a backward pass"
            )
        return boundary, trace

    def _call(
        self,
        stage: str,
        kind: Kind,
        units: float,
        inputs: tuple[torch.Tensor, ...],
        *,
        grad_outputs: tuple[torch.Tensor, ...] = (),
        prefer: WorkerKey | None = None,
    ) -> tuple[WorkerKey, list[torch.Tensor]]:
        client = self.clients[stage]
        excluded: set[WorkerKey] = set()
        attempts, attempts_on_worker = 0, 0
        while True:
            lease = self._lease(stage, kind, units, excluded, prefer)
            attempts_on_worker = attempts_on_worker + 1 if lease.key == prefer else 1
            attempts += 1
            started = time.monotonic()
            try:
                if kind == "forward":
                    outputs = client.forward(lease.worker, inputs)
                else:
                    outputs = client.backward(lease.worker, inputs, grad_outputs)
            except Exception as error:  # every RPC failure is classified; none may kill the trainer
                step = self._retry_step(stage, kind, lease, error, started, attempts, attempts_on_worker)
                if step is ErrorClass.RETRY_SAME:
                    prefer = lease.key
                else:
                    excluded.add(lease.key)
                    prefer = None
                continue
            return lease.key, self._succeeded(stage, kind, units, lease, inputs, grad_outputs, outputs)

    def _lease(self, stage: str, kind: Kind, units: float, excluded: set[WorkerKey], prefer: WorkerKey | None) -> Lease:
        """A worker of ``stage`` for one request; while the whole stage is unreachable or banned, wait for one."""
        balancer = self.router[stage]
        lease = balancer.choose(kind, units, exclude=excluded, prefer=prefer)
        while lease is None:  # whole stage unreachable or banned: wait, it resumes by itself
            if self.stop.is_set():
                raise RequestFailed("stopping")
            self.stall.stalled(stage)
            excluded.clear()
            time.sleep(STALL_POLL_SECONDS)
            lease = balancer.choose(kind, units, prefer=prefer)
        return lease

    def _retry_step(
        self,
        stage: str,
        kind: Kind,
        lease: Lease,
        error: Exception,
        started: float,
        attempts: int,
        attempts_on_worker: int,
    ) -> ErrorClass:
        """Report a failed request; how to retry it, or RequestFailed when the policy gives up."""
        verdict = self.router[stage].report_failure(lease, error)
        step = self.policy.next_step(verdict.error_class, attempts, attempts_on_worker)
        self._report_failure(stage, kind, lease.worker.uid, time.monotonic() - started, verdict, step, error)
        if step is None:
            raise RequestFailed(
                f"{stage} {kind} given up after {attempts} attempt(s) on {lease.worker.uid}: {error}"
            ) from error
        return step

    def _succeeded(
        self,
        stage: str,
        kind: Kind,
        units: float,
        lease: Lease,
        inputs: tuple[torch.Tensor, ...],
        grad_outputs: tuple[torch.Tensor, ...],
        outputs: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Count a request that succeeded (the stage is back, a receipt); its outputs, spot-checked if due."""
        self.router[stage].report_success(lease)
        self.stall.resumed(stage)  # only a request that succeeded proves the stage is back
        if self.receipts is not None:
            self.receipts.count(stage, kind, lease.worker.peer_id, inputs)
        if self.spot_checks is not None:
            outputs = self.spot_checks.review(stage, kind, units, lease.worker, inputs, grad_outputs, outputs)
        return outputs

    def _report_failure(
        self,
        stage: str,
        kind: Kind,
        uid: str,
        elapsed: float,
        verdict: FailureVerdict,
        step: ErrorClass | None,
        error: Exception,
    ) -> None:
        what_next = {
            None: "giving up",
            ErrorClass.RETRY_SAME: "retrying there",
            ErrorClass.RETRY_OTHER: "retrying elsewhere",
        }
        detail = (str(error).strip().splitlines() or [error.__class__.__name__])[0][:160]
        self.on_failure(
            f"{stage} {kind} on {uid} failed after {elapsed:.1f}s ({verdict.error_class.value}"
            f"{', banned' if verdict.banned else ''}): {detail}; {what_next[step]}"
        )
