"""What a worker counts about itself, for the monitor (points) and the client (live estimate).

The worker calls ``on_forward`` / ``on_backward`` once per request, ``set_phase`` on every sync
transition and ``on_sparta_round`` after every averaging round; ``snapshot()`` returns the
``MetricsRecord`` it publishes (``agora_client.monitor.records.publish_metrics``).
Every counter is monotonic for the life of the object; ``run_id`` tells the monitor when a
restarted worker begins again from zero.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

from agora_client.config import ModelConfig
from agora_client.events import SyncPhase
from agora_client.monitor.flops import request_flops
from agora_client.monitor.points import COMPUTE_PHASES
from agora_client.monitor.records import MetricsRecord

TokensLike = torch.Tensor | Sequence[int]  # a [batch, seq] token tensor, or its shape


def _batch_and_seq(tokens: TokensLike) -> tuple[int, int]:
    shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else tuple(tokens)
    if len(shape) != 2:
        raise ValueError(f"tokens must be [batch, seq]; got shape {shape}")
    return int(shape[0]), int(shape[1])


class WorkerMetrics:
    """Thread-safe counters of one worker process (connection handlers and the runtime update them)."""

    def __init__(
        self,
        model: ModelConfig,
        stage: str,
        *,
        peer_id: str,
        identity: str,
        ticket: str,
        compress_boundary: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        model.stage(stage)  # unknown stage: ConfigError now, not on the first request
        self.stage, self.peer_id, self.identity = stage, peer_id, identity
        self.run_id = secrets.token_hex(8)
        self._ticket = ticket
        self._clock, self._wall_clock = clock, wall_clock
        self._lock = threading.Lock()

        @lru_cache(maxsize=64)
        def flops(kind: str, batch: int, seq: int) -> int:
            return request_flops(model, stage, kind, batch, seq, compress_boundary=compress_boundary)

        self._flops = flops
        self._phase: SyncPhase | None = None  # None: not (or no longer) registered in the swarm
        self._phase_since = clock()
        self._active_before = 0.0  # seconds registered, up to _phase_since
        self.flops_total = 0
        self.compute_flops = 0
        self.busy_seconds = 0.0
        self.batches = 0
        self.forwards = 0
        self.tokens = 0
        self.sparta_rounds = 0
        self._sparta_succeeded = 0
        self.sparta_last_fraction = 0.0
        self.sparta_drift: tuple[float, float] | None = None  # (before, after) of the latest round that measured it

    def set_phase(self, phase: SyncPhase | None) -> None:
        """Enter sync1 / sync2 / active, or None when the worker leaves the swarm."""
        with self._lock:
            now = self._clock()
            if self._phase is not None:
                self._active_before += now - self._phase_since
            self._phase, self._phase_since = phase, now

    def set_ticket(self, ticket: str) -> None:
        """A renewed auth ticket (the old one expired)."""
        with self._lock:
            self._ticket = ticket

    @property
    def phase(self) -> SyncPhase | None:
        return self._phase

    def on_forward(self, tokens: TokensLike, busy_seconds: float = 0.0) -> int:
        """Count one forward request; returns the FLOPs it added."""
        batch, seq = _batch_and_seq(tokens)
        return self._add(self._flops("forward", batch, seq), busy_seconds, forwards=1)

    def on_backward(self, tokens: TokensLike, busy_seconds: float = 0.0) -> int:
        """Count one backward request (recomputed forward + backward, one microbatch); returns the FLOPs it added."""
        batch, seq = _batch_and_seq(tokens)
        return self._add(self._flops("backward", batch, seq), busy_seconds, batches=1, tokens=batch * seq)

    def _add(self, flops: int, busy_seconds: float, *, forwards: int = 0, batches: int = 0, tokens: int = 0) -> int:
        with self._lock:
            self.flops_total += flops
            if self._phase in COMPUTE_PHASES:
                self.compute_flops += flops
            self.busy_seconds += max(0.0, busy_seconds)
            self.forwards += forwards
            self.batches += batches
            self.tokens += tokens
        return flops

    def on_sparta_round(
        self,
        succeeded: bool,
        averaged_fraction: float,
        drift_before: float | None = None,
        drift_after: float | None = None,
    ) -> None:
        """One averaging round: did it average anything, what share of the group's tensor it averaged (0..1), and
        its slice's drift from the group's average before and after the update (None: not measured; the previous
        round's figures stay)."""
        with self._lock:
            self.sparta_rounds += 1
            self._sparta_succeeded += int(succeeded)
            self.sparta_last_fraction = min(1.0, max(0.0, averaged_fraction))
            if drift_before is not None and drift_after is not None:
                self.sparta_drift = (max(0.0, drift_before), max(0.0, drift_after))

    def active_seconds(self) -> float:
        with self._lock:
            return self._active_seconds_locked()

    def _active_seconds_locked(self) -> float:
        running = self._clock() - self._phase_since if self._phase is not None else 0.0
        return self._active_before + running

    def snapshot(self) -> MetricsRecord:
        """The record to publish; raises ValueError before the worker has entered sync phase 1."""
        with self._lock:
            if self._phase is None:
                raise ValueError("no metrics to publish: the worker is not registered in the swarm (no sync phase yet)")
            return MetricsRecord(
                peer_id=self.peer_id,
                identity=self.identity,
                ticket=self._ticket,
                stage=self.stage,
                run_id=self.run_id,
                sync_phase=self._phase,
                flops_total=float(self.flops_total),
                compute_flops=float(self.compute_flops),
                active_seconds=self._active_seconds_locked(),
                busy_seconds=self.busy_seconds,
                batches=self.batches,
                forwards=self.forwards,
                tokens=self.tokens,
                sparta_rounds=self.sparta_rounds,
                sparta_success_rate=self._sparta_succeeded / self.sparta_rounds if self.sparta_rounds else 0.0,
                sparta_last_fraction=self.sparta_last_fraction,
                sparta_drift_before=self.sparta_drift[0] if self.sparta_drift else None,
                sparta_drift_after=self.sparta_drift[1] if self.sparta_drift else None,
                ts=self._wall_clock(),
            )
