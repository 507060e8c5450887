"""SPARTA: sparse parameter averaging between the workers of one stage.

Every round, the workers of a stage that are due find each other through hivemind matchmaking
over the DHT and average one rotating slice of their parameters (see partition.py) with hivemind's
butterfly all-reduce, in float32, uncompressed. Training keeps stepping while a round is in flight,
so the result is applied as a delta: param_slice += averaged - sent. Optimizer moments stay local.

Threads and processes:
- the caller (the training loop) calls begin_round; it holds `lock` only while copying the slice out;
- one background thread ("sparta-round") waits for hivemind, then holds `lock` while adding the delta,
  and calls on_round(report);
- hivemind's averager runs in its own process and exchanges a shared float32 CPU buffer.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter, azip

from agora_client.config import SpartaConfig
from agora_client.events import SpartaEvent
from agora_client.worker.partition import StridedPartition, partition_of

_SENT, _RECEIVED = 0, 1


@dataclass(frozen=True)
class RoundReport:
    """What one SPARTA round did, as seen by this worker."""

    round: int
    partition: int
    group_size: int  # peers matched for the round, this worker included; 0 if no group formed
    fraction: float  # share of this worker's slice that came back averaged with at least one other peer
    bytes_sent: int  # serialized averaging messages (protobuf bytes), without libp2p framing and encryption
    bytes_received: int
    duration_s: float
    weight: float
    ok: bool
    reason: str | None = None

    def to_event(self) -> SpartaEvent:
        return SpartaEvent(
            round=self.round,
            partition=self.partition,
            group_size=self.group_size,
            fraction=self.fraction,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            duration_s=self.duration_s,
            weight=self.weight,
            ok=self.ok,
            reason=self.reason,
        )


class _MeteredStub:
    """A groupmate's stub whose averaged-part replies are counted as received."""

    def __init__(self, stub: Any, count_received: Callable[[AsyncIterator], AsyncIterator]):
        self._stub, self._count_received = stub, count_received

    async def rpc_aggregate_part(self, inputs: AsyncIterator[averaging_pb2.AveragingData]) -> AsyncIterator:
        return self._count_received(await self._stub.rpc_aggregate_part(inputs))


class _MeteredAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, counting the serialized bytes of every message on the wire."""

    def __init__(self, *, traffic: torch.Tensor, **kwargs: Any):
        super().__init__(**kwargs)
        self._traffic = traffic

    async def _count_received(self, stream: AsyncIterator[averaging_pb2.AveragingData]) -> AsyncIterator:
        async for message in stream:
            self._traffic[_RECEIVED] += message.ByteSize()
            yield message

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._traffic[_SENT] += message.ByteSize()
            yield message

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _MeteredStub(super()._get_peer_stub(peer), self._count_received)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(self._count_received(stream), context):
            self._traffic[_SENT] += message.ByteSize()
            yield message

    def unshared_elements(self) -> int:
        """Elements of this slice that were not averaged with any other peer.

        Parts whose remote reducer failed come back as zero deltas (hivemind counts them in failed_size);
        parts this peer reduced itself count only if at least one other sender's data made it in.
        """
        reducer = self.tensor_part_reducer
        lonely = sum(
            shape.numel()
            for index, shape in enumerate(reducer.part_shapes)
            if sum(index < failed_after for failed_after in reducer.sender_failed_after) < 2
        )
        return self.tensor_part_container.failed_size + lonely


class _GroupAverager(DecentralizedAverager):
    """hivemind's averager with SPARTA's group rules. Runs in its own process, like its parent class."""

    # hivemind's averager hands its shared buffer and pipes to its process by fork; keep fork even in a spawned host
    _start_method, _Popen = "fork", staticmethod(mp.get_context("fork").Process._Popen)

    def __init__(self, buffer: torch.Tensor, dht: DHT, *, layout: bytes, **kwargs: Any):
        super().__init__([buffer], dht, start=False, **kwargs)
        # peers that slice their parameters differently must never match: fold the layout into the schema
        self.schema_hash = hashlib.blake2b(self.schema_hash + layout, digest_size=20).digest()
        self.traffic = torch.zeros(2, dtype=torch.int64).share_memory_()

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host process decides when this one ends
        super().run()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # hivemind's version ignores SIGINT in the host process (and fails off the main thread); run() does it here
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        # every peer decodes the same gathered weights, so all of them take the same decision
        weights = [self.serializer.loads(self.serializer.loads(raw)[2])["weight"] for raw in group_info.gathered]
        if not any(weight > 0 for weight in weights):
            return dict(group_size=group_info.group_size, skipped="every worker in the group had weight 0", unshared=0)
        self._unshared = 0
        await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return dict(group_size=group_info.group_size, skipped=None, unshared=self._unshared)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs: Any
    ) -> None:
        # hivemind builds AllReduceRunner by name here; this override is the only way to meter the wire
        group_id = group_info.group_id if group_id is None else group_id
        runner = _MeteredAllReduceRunner(
            traffic=self.traffic,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        async for tensor, delta in azip(as_aiter(*tensors), runner):
            tensor.add_(delta)  # parts whose reducer failed arrive as zero deltas and keep the local value
        self._unshared = runner.unshared_elements()


class SpartaAverager:
    """Averages one rotating slice of a stage's parameters with the other workers of the stage.

    :param dht: a running hivemind DHT of this worker
    :param prefix: DHT/matchmaking namespace shared by the workers of one stage, without '.' (e.g. "run_body1_sparta")
    :param parameters: the stage's trainable parameters, in the same order on every worker
    :param lock: the lock the training loop holds while it changes the parameters (optimizer.step, loading state);
      SPARTA holds it only to copy the slice out (begin_round) and to add the delta (round thread)
    :param on_round: called with each RoundReport from the round thread ("sparta-round"), or from the caller's
      thread for a round skipped because the previous one is still in flight; it must not block for long
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        parameters: Sequence[torch.nn.Parameter],
        config: SpartaConfig,
        *,
        lock: threading.Lock,
        on_round: Callable[[RoundReport], None] | None = None,
        start: bool = True,
    ):
        if not prefix or "." in prefix:
            raise ValueError(f"SPARTA prefix must be a non-empty name without '.', got {prefix!r}")
        self._parameters = list(parameters)
        self.partition = StridedPartition.of(self._parameters, config.num_partitions)
        self._lock, self._on_round = lock, on_round
        self._find_group_timeout = 3 * config.matchmaking_time
        self._round_timeout = self._find_group_timeout + config.allreduce_timeout + config.matchmaking_time
        self._buffer = torch.zeros(self.partition.max_slice_size, dtype=torch.float32)
        self._averager = _GroupAverager(
            self._buffer,
            dht,
            layout=self.partition.fingerprint,
            prefix=prefix,
            min_group_size=2,
            min_matchmaking_time=config.matchmaking_time,
            request_timeout=config.matchmaking_time / 2,
            allreduce_timeout=config.allreduce_timeout,
            sender_timeout=config.sender_timeout,
            # a reducer first waits up to sender_timeout for its slowest sender, then gets its own reducer_timeout
            reducer_timeout=config.sender_timeout + config.reducer_timeout,
            allow_state_sharing=False,
            part_size_bytes=_part_size_bytes(self._buffer),
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparta-round")
        self._begin_lock = threading.Lock()
        self._in_flight: Future[RoundReport] | None = None
        self._control: StepControl | None = None
        if start:
            self.start()

    def start(self) -> None:
        self._averager.run_in_background(await_ready=True)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def begin_round(self, round_no: int, weight: float) -> Future[RoundReport]:
        """Start averaging slice round_no mod P with weight (0 = receive only); returns at once."""
        if round_no < 0:
            raise ValueError(f"round number must be >= 0, got {round_no}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"SPARTA weight must be a finite number >= 0, got {weight}")
        started, part = time.monotonic(), partition_of(round_no, self.partition.num_partitions)
        with self._begin_lock:
            if self.in_flight:
                done: Future[RoundReport] = Future()
                done.set_result(self._publish(RoundReport(
                    round_no, part, 0, 0.0, 0, 0, 0.0, float(weight), ok=False,
                    reason="skipped: the previous round is still in flight",
                )))
                return done
            sent = torch.empty(self.partition.slice_size(part), dtype=torch.float32)
            with self._lock:
                self.partition.gather(self._parameters, part, sent)
            self._in_flight = self._executor.submit(self._run_round, round_no, part, float(weight), sent, started)
            return self._in_flight

    def _run_round(self, round_no: int, part: int, weight: float, sent: torch.Tensor, started: float) -> RoundReport:
        size = sent.numel()
        with self._averager.get_tensors() as (buffer,):
            buffer.zero_()
            buffer[:size].copy_(sent)
        self._averager.traffic.zero_()
        group_size, fraction, reason = 0, 0.0, None
        try:
            if not self._averager.is_alive():
                raise RuntimeError("hivemind's averager process is not running")
            # one matchmaking key per round: workers on another round never land in this group
            self._averager.set_group_bits(format(round_no, "b"), wait=False).result(timeout=self._find_group_timeout)
            outcome = self._run_step({"weight": weight}, weight)
        except Exception as error:
            reason = _describe_failure(error, self._find_group_timeout)
        else:
            group_size, reason = outcome["group_size"], outcome["skipped"]
            if reason is None:
                with self._averager.get_tensors() as (buffer,):
                    delta = buffer[:size] - sent
                broken = ~torch.isfinite(delta)  # a part whose only surviving senders had weight 0 divides by zero
                delta[broken] = 0.0
                with self._lock:
                    self.partition.add_(self._parameters, part, delta)
                averaged = size - min(size, outcome["unshared"] + int(broken.sum()))
                fraction = averaged / size if size else 1.0
                if averaged < size:
                    reason = f"{size - averaged} of {size} elements kept their local values: a peer dropped out"
        traffic = self._averager.traffic.tolist()
        return self._publish(RoundReport(
            round=round_no,
            partition=part,
            group_size=group_size,
            fraction=fraction,
            bytes_sent=int(traffic[_SENT]),
            bytes_received=int(traffic[_RECEIVED]),
            duration_s=time.monotonic() - started,
            weight=weight,
            ok=group_size > 0 and fraction > 0,
            reason=reason,
        ))

    def _run_step(self, gather: dict, weight: float) -> dict:
        """Matchmaking and all-reduce in hivemind's process; returns _GroupAverager._aggregate_with_group's dict."""
        control = self._averager.step(
            gather=gather, weight=weight, timeout=self._find_group_timeout, allow_retries=False, wait=False
        )
        self._control = control
        try:
            return control.result(timeout=self._round_timeout)
        except TimeoutError:
            control.cancel()
            raise

    def _publish(self, report: RoundReport) -> RoundReport:
        if self._on_round is not None:
            self._on_round(report)
        return report

    def shutdown(self) -> None:
        """Cancel a round still looking for its group, wait for the round thread, stop hivemind's process."""
        if self.in_flight and self._control is not None and not self._control.done():
            self._control.cancel()
        self._executor.shutdown(wait=True)
        if self._averager.is_alive():
            self._averager.shutdown()


def _part_size_bytes(buffer: torch.Tensor) -> int:
    # hivemind hands each whole part to one reducer: parts much smaller than a slice spread the load evenly
    # over the group (a slice in one part means one peer reduces everything); 8 KiB keeps headers under 1%
    return min(DEFAULT_PART_SIZE_BYTES, max(8 * 1024, buffer.numel() * buffer.element_size() // 64))


def _describe_failure(error: BaseException, find_group_timeout: float) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, CancelledError):
        return "cancelled: the averager is shutting down"
    if "could not find a group" in text:
        return f"no other worker of this stage joined the round within {find_group_timeout:.0f}s"
    if isinstance(error, TimeoutError):
        return "the round did not finish within its time bound"
    return f"{type(error).__name__}: {text}"
