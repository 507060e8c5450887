"""SPARTA: sparse parameter averaging between the workers of one stage.

Every round, the workers of a stage that are due find each other through hivemind matchmaking
over the DHT and average one rotating slice of their parameters (see partition.py) with hivemind's
butterfly all-reduce, in float32, uncompressed. Training keeps stepping while a round is in flight,
so the result is applied as a delta: param_slice += averaged - sent. Optimizer moments stay local.

Matchmaking: every round has its own group key, so workers on different rounds never meet. The first
worker of the stage to reach a round leads it and waits up to ``2 x matchmaking_time`` for the others
(their epoch boundaries arrive at slightly different moments), and never past half the time between
two rounds; the group is assembled as soon as every worker the stage counts has joined. A round still looking for its group when the next one is due
gives way to it, so one missed round never makes the next one miss as well; a round due while the
previous one is still averaging waits for it (another slice: the two never touch the same parameters).

Each peer's influence is bounded (bounds.py): reducers bound every sender's part, senders bound every
averaged part that comes back; the peers that had to be bounded are named in the round's report.
With tickets on (group_admission.py), only workers of this stage holding the auth service's ticket are
let into a group; a group with anyone else in it is refused, and the round's report names them.

Threads and processes:
- the caller (the training loop) calls begin_round; it holds `lock` only while copying the slice out;
- one background thread ("sparta-round") waits for hivemind, then holds `lock` while adding the delta,
  and calls on_round(report);
- hivemind's averager runs in its own process and exchanges a shared float32 CPU buffer.
"""

from __future__ import annotations

import hashlib
import logging
import math
import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartReducer
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from agora_client.config import SpartaConfig
from agora_client.events import SpartaEvent
from agora_client.averaging.bounds import bounded, bounded_weight
from agora_client.averaging.group_admission import GroupAdmission
from agora_client.averaging.partition import StridedPartition, partition_of

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
    suspects: tuple[tuple[str, str], ...] = ()  # (peer id, what it sent) for every peer whose numbers were bounded

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


class _BoundedPartReducer(TensorPartReducer):
    """hivemind's reducer; each sender's part is first bounded against this peer's own part of the slice."""

    def __init__(
        self, own_parts: Sequence[torch.Tensor], num_senders: int, max_ratio: float, on_bounded: Callable[[int, str], None]
    ):
        super().__init__(tuple(part.shape for part in own_parts), num_senders)
        self._own_parts, self._max_ratio, self._on_bounded = own_parts, max_ratio, on_bounded

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        weight = bounded_weight(weight)
        if 0 <= part_index < self.num_parts:  # hivemind itself refuses other indices
            tensor_part, problem = bounded(self._own_parts[part_index], tensor_part, self._max_ratio)
            if problem is not None:
                self._on_bounded(sender_index, problem)
                if problem.startswith(("non-finite", "a part of shape")):
                    weight = 0.0  # nothing of it enters the average
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)


class _SpartaAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, counting the serialized bytes of every message on the wire and
    bounding every peer's influence (as a sender here, as a reducer in bound_received)."""

    def __init__(self, *, traffic: torch.Tensor, max_ratio: float, **kwargs: Any):
        super().__init__(**kwargs)
        self._traffic, self._max_ratio = traffic, max_ratio
        self.suspects: dict[PeerID, str] = {}
        self.discarded = 0  # elements whose averaged value came back non-finite and was not used
        # hivemind builds its reducer by name; marking that one finished keeps its __del__ quiet
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = _BoundedPartReducer(
            self.parts_for_local_averaging,
            len(self.sender_peer_ids),
            max_ratio,
            lambda sender, problem: self._suspect(self.sender_peer_ids[sender], f"sent {problem}"),
        )

    def _suspect(self, peer: PeerID, problem: str) -> None:
        self.suspects.setdefault(peer, problem)

    def bound_received(self, local: torch.Tensor, delta: torch.Tensor) -> None:
        """Bound, in place, the averaged deltas that each remote reducer sent back for its parts of ``local``."""
        part_values = int(self.tensor_part_container.part_size_bytes / local.element_size())
        parts = iter(zip(local.view(-1).split(part_values), delta.view(-1).split(part_values)))
        for peer, count in zip(self.ordered_peer_ids, self.tensor_part_container.num_parts_by_peer):
            for own, change in (next(parts) for _ in range(count)):
                if peer == self.peer_id:
                    continue  # our own reduction used bounded parts already
                value, problem = bounded(own, own + change, self._max_ratio)
                if problem is not None:
                    self._suspect(peer, f"returned {problem}")
                    if problem.startswith("non-finite"):
                        self.discarded += change.numel()
                    change.copy_(value - own)

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
        return self.tensor_part_container.failed_size + lonely + self.discarded


class _GroupAverager(DecentralizedAverager):
    """hivemind's averager with SPARTA's group rules. Runs in its own process, like its parent class."""

    # hivemind's averager hands its shared buffer and pipes to its process by fork; keep fork even in a spawned host
    _start_method, _Popen = "fork", staticmethod(mp.get_context("fork").Process._Popen)

    def __init__(
        self, buffer: torch.Tensor, dht: DHT, *, layout: bytes, max_peer_delta: float,
        admission: GroupAdmission | None, **kwargs: Any,
    ):
        super().__init__([buffer], dht, start=False, **kwargs)
        self._admission = admission
        # peers that slice their parameters differently must never match: fold the layout into the schema
        self.schema_hash = hashlib.blake2b(self.schema_hash + layout, digest_size=20).digest()
        self.traffic = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._max_peer_delta = max_peer_delta

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host process decides when this one ends
        for name in _ROUND_LOGGERS:  # a logger's filter sees only its own records, not its children's
            logging.getLogger(name).addFilter(_reported_by_the_round)
        logging.getLogger("asyncio").addFilter(_not_cancel_noise)
        super().run()

    def set_round(self, group_bits: str, target_group_size: int | None) -> MPFuture:
        """Use this group key, and assemble the group as soon as it has target_group_size peers (None: at the deadline)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_round", [], dict(group_bits=group_bits, target_group_size=target_group_size, future=future)))
        return future

    async def _set_round(self, group_bits: str, target_group_size: int | None, future: MPFuture) -> None:
        self._matchmaking.group_key_manager.group_bits = group_bits
        self._matchmaking.target_group_size = target_group_size
        future.set_result(None)

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # hivemind's version ignores SIGINT in the host process (and fails off the main thread); run() does it here
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def _user_data(self, gathered: bytes) -> Any:
        """What a peer passed as ``gather`` to its step (None if a stranger sent something else)."""
        try:
            return self.serializer.loads(self.serializer.loads(gathered)[2])
        except Exception:
            return None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        # as a leader: a peer without a ticket for this stage never gets into our group
        if self._admission is not None:
            peer = context.remote_id.to_base58()
            if self._admission.refusal(peer, self._user_data(request.gather)) is not None:
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
        async for message in super().rpc_join_group(request, context):
            yield message

    def _refused_members(self, group_info: GroupInfo, members: list[Any]) -> str | None:
        """Why this group may not average (a member without a valid ticket), or None."""
        if self._admission is None:
            return None
        for peer, data in zip(group_info.peer_ids, members):
            refusal = None if peer == self.peer_id else self._admission.refusal(peer.to_base58(), data)
            if refusal is not None:
                return f"refused: peer {peer.to_base58()} may not average with this stage ({refusal})"
        return None

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> dict:
        # every peer decodes the same gathered data, so all of them take the same decision
        members = [self._user_data(raw) for raw in group_info.gathered]
        refused = self._refused_members(group_info, members)
        if refused is not None:
            return dict(group_size=group_info.group_size, skipped=refused, unshared=0)
        weights = [member.get("weight") if isinstance(member, dict) else None for member in members]
        if not any(isinstance(weight, (int, float)) and weight > 0 for weight in weights):  # malformed: weight 0
            return dict(group_size=group_info.group_size, skipped="every worker in the group had weight 0", unshared=0)
        self._unshared, self._suspects = 0, {}
        await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return dict(group_size=group_info.group_size, skipped=None, unshared=self._unshared, suspects=self._suspects)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs: Any
    ) -> None:
        # hivemind builds AllReduceRunner by name here; this override is the only way to meter and bound the wire
        group_id = group_info.group_id if group_id is None else group_id
        runner = _SpartaAllReduceRunner(
            traffic=self.traffic,
            max_ratio=self._max_peer_delta,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        try:
            async for tensor, delta in azip(as_aiter(*tensors), runner):
                runner.bound_received(tensor, delta)
                tensor.add_(delta)  # parts whose reducer failed arrive as zero deltas and keep the local value
        finally:
            self._suspects = {peer.to_base58(): problem for peer, problem in runner.suspects.items()}
        self._unshared = runner.unshared_elements()


_ROUND_LOGGERS = (
    "hivemind.averaging.averager",
    "hivemind.averaging.allreduce",
    "hivemind.averaging.partition",
    "hivemind.utils.asyncio",  # tracebacks of matchmaking tasks torn down by a cancelled step
)
# partial rounds: the RoundReport says how much was kept
_REPORTED_MESSAGES = ("did not finish", "Reducer: received", "Averaging: received")


def _reported_by_the_round(record: logging.LogRecord) -> bool:
    """hivemind logs a failed step with its traceback; SpartaAverager reports it as one RoundReport instead."""
    if record.exc_info is not None:
        return False
    message = record.getMessage()
    return not any(text in message for text in _REPORTED_MESSAGES)


def _not_cancel_noise(record: logging.LogRecord) -> bool:
    """What asyncio reports when a round is called off (SpartaAverager reported the round already): a step
    cancelled just as its group formed cannot take its result; matchmaking tasks torn down mid-way."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, InvalidStateError) and "CANCELLED" in str(error):
        return False
    if isinstance(error, RuntimeError) and "asynchronous generator is already running" in str(error):
        return False
    return not record.getMessage().startswith("Task was destroyed but it is pending")


@dataclass
class _Flight:
    """One round begun by begin_round, as the caller's and the round's threads both see it."""

    round_no: int
    gather_window: float  # seconds a leader waits for the whole stage to join
    future: Future[RoundReport] | None = None
    control: StepControl | None = None  # hivemind's step, once it has been asked for
    stop_reason: str | None = None  # why it was called off (a newer round was due, shutdown) before averaging
    asked_at: float = 0.0  # monotonic time its step was asked for


class SpartaAverager:
    """Averages one rotating slice of a stage's parameters with the other workers of the stage.

    :param dht: a running hivemind DHT of this worker
    :param prefix: DHT/matchmaking namespace shared by the workers of one stage, without '.' (e.g. "run_body1_sparta")
    :param parameters: the stage's trainable parameters, in the same order on every worker
    :param lock: the lock the training loop holds while it changes the parameters (optimizer.step, loading state);
      SPARTA holds it only to copy the slice out (begin_round) and to add the delta (round thread)
    :param on_round: called with each RoundReport from the round thread ("sparta-round"), or from the caller's
      thread for a round skipped because the previous one is still in flight; it must not block for long
    :param stage_size: how many workers the stage has now (this one included), asked from the round thread
      at the start of every round: the group is assembled as soon as that many have joined
    :param admission: the ticket check for groupmates and this worker's own ticket (None: anyone may average)
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
        stage_size: Callable[[], int] | None = None,
        admission: GroupAdmission | None = None,
        start: bool = True,
    ):
        if not prefix or "." in prefix:
            raise ValueError(f"SPARTA prefix must be a non-empty name without '.', got {prefix!r}")
        self._parameters = list(parameters)
        self.partition = StridedPartition.of(self._parameters, config.num_partitions)
        self._lock, self._on_round, self._stage_size = lock, on_round, stage_size
        # the leader waits up to this long for the stage's other workers, whose epochs end a little later than its own
        self._max_gather_window = 2 * config.matchmaking_time
        self._last_begin: float | None = None  # when the previous round began (time.monotonic)
        self._find_group_timeout = 3 * config.matchmaking_time
        self._group_needs = config.matchmaking_time + self._max_gather_window  # hivemind's minimum, then the gathering
        self._round_timeout = self._find_group_timeout + config.allreduce_timeout + config.matchmaking_time
        self._buffer = torch.zeros(self.partition.max_slice_size, dtype=torch.float32)
        self._averager = _GroupAverager(
            self._buffer,
            dht,
            layout=self.partition.fingerprint,
            max_peer_delta=config.max_peer_delta,
            admission=admission,
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
        self._credentials = (lambda: {}) if admission is None else (lambda: admission.credentials(dht.peer_id.to_base58()))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparta-round")
        self._begin_lock = threading.Lock()
        self._flight = _Flight(-1, 0.0)  # the latest round begun
        if start:
            self.start()

    def start(self) -> None:
        self._averager.run_in_background(await_ready=True)

    @property
    def in_flight(self) -> bool:
        return self._flight.future is not None and not self._flight.future.done()

    def begin_round(self, round_no: int, weight: float) -> Future[RoundReport]:
        """Start averaging slice round_no mod P with weight (0 = receive only); returns at once."""
        if round_no < 0:
            raise ValueError(f"round number must be >= 0, got {round_no}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"SPARTA weight must be a finite number >= 0, got {weight}")
        started, part = time.monotonic(), partition_of(round_no, self.partition.num_partitions)
        with self._begin_lock:
            # a full-parameter round (one slice) cannot wait behind the previous one: that one averages the same slice
            if self.in_flight and not self._supersede(round_no) and self.partition.num_partitions == 1:
                done: Future[RoundReport] = Future()
                done.set_result(self._publish(RoundReport(
                    round_no, part, 0, 0.0, 0, 0, 0.0, float(weight), ok=False,
                    reason="skipped: the previous round is still averaging",
                )))
                return done
            sent = torch.empty(self.partition.slice_size(part), dtype=torch.float32)
            with self._lock:
                self.partition.gather(self._parameters, part, sent)
            self._flight = flight = _Flight(round_no, self._gather_window(started))
            flight.future = self._executor.submit(self._run_round, flight, round_no, part, float(weight), sent, started)
            return flight.future

    def _gather_window(self, now: float) -> float:
        """How long a leader waits for a full group: never past half the time between two rounds, so that a
        peer that died (still counted in the stage until its record expires) cannot make the round overrun."""
        interval = None if self._last_begin is None else now - self._last_begin
        self._last_begin = now
        return self._max_gather_window if interval is None else min(self._max_gather_window, max(0.5, interval / 2))

    def _supersede(self, round_no: int) -> bool:
        """Call off the latest round if it has not found its group in the time a group needs (its peers have
        moved on too). A younger one keeps matchmaking and the new round waits behind it: when rounds come
        faster than groups form, giving way every time would leave no round to finish."""
        flight = self._flight
        young = flight.control is not None and time.monotonic() - flight.asked_at < self._group_needs
        if young and not flight.control.done():
            return False
        return self._call_off(flight, f"gave way to round {round_no}: no group formed before it was due")

    @staticmethod
    def _call_off(flight: _Flight, reason: str) -> bool:
        """Stop a round that is waiting for its turn or still matchmaking; False if it is averaging already."""
        control = flight.control
        if control is not None and (control.done() or control.stage != AveragingStage.LOOKING_FOR_GROUP):
            return False
        flight.stop_reason = reason
        if control is not None:  # else the round stops itself before, or as soon as, it has its control
            control.cancel()
        return True

    def _run_round(
        self, flight: _Flight, round_no: int, part: int, weight: float, sent: torch.Tensor, started: float
    ) -> RoundReport:
        size = sent.numel()
        with self._averager.get_tensors() as (buffer,):
            buffer.zero_()
            buffer[:size].copy_(sent)
        self._averager.traffic.zero_()
        group_size, fraction, reason, suspects = 0, 0.0, None, {}
        try:
            if not self._averager.is_alive():
                raise RuntimeError("hivemind's averager process is not running")
            if flight.stop_reason is not None:  # called off while it waited behind the previous round
                raise CancelledError()
            stage_size = self._stage_size() if self._stage_size is not None else 0
            # one matchmaking key per round: workers on another round never land in this group
            self._averager.set_round(format(round_no, "b"), stage_size if stage_size >= 2 else None).result(
                timeout=self._find_group_timeout
            )
            outcome = self._run_step(flight, {"weight": weight, **self._credentials()}, weight)
        except Exception as error:
            if flight.stop_reason is not None:
                reason = flight.stop_reason
            else:
                reason = _describe_failure(error, self._find_group_timeout)
        else:
            group_size, reason, suspects = outcome["group_size"], outcome["skipped"], outcome.get("suspects", {})
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
            suspects=tuple(sorted(suspects.items())),
        ))

    def _run_step(self, flight: _Flight, gather: dict, weight: float) -> dict:
        """Matchmaking and all-reduce in hivemind's process; returns _GroupAverager._aggregate_with_group's dict."""
        control = self._averager.step(
            gather=gather,
            weight=weight,
            scheduled_time=get_dht_time() + flight.gather_window,
            timeout=self._find_group_timeout,
            allow_retries=False,
            wait=False,
        )
        flight.asked_at = time.monotonic()  # before control: a reader that sees the control sees its age
        flight.control = control
        if flight.stop_reason is not None:  # called off before it had a control to cancel
            control.cancel()
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
        self._call_off(self._flight, "cancelled: the averager is shutting down")
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
