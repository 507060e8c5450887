"""hivemind's decentralized averager and butterfly all-reduce, with the seams SPARTA needs and upstream lacks.

- RoundAverager: a group key and a target group size set per round, a check of every joiner (as a leader)
  and of every assembled group, time bounds and part shares set per group from what its members announce,
  the protobuf bytes of every averaging message counted, and a step whose result says what the round did
  (RoundOutcome) instead of only the gathered data.
- ScreenedAllReduce: every sender's part passes a PartScreen before this peer reduces it, every averaged
  part a remote reducer returns passes it too, and the elements nobody else averaged are counted.

Each private name of hivemind.averaging used here is checked against the installed hivemind by
tests/test_engine_contract.py, so an upgrade that moves one fails there, by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import CancelledError, InvalidStateError
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Protocol, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartContainer, TensorPartReducer
from hivemind.dht import DHT
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter, azip

from .upload_pacing import UploadPacer

__all__ = [
    "DEFAULT_PART_SIZE_BYTES",
    "GroupTimeouts",
    "PartScreen",
    "RoundAverager",
    "RoundOutcome",
    "ScreenedAllReduce",
    "found_no_group",
    "parts_by_reducer",
    "rebuild_torch_thread_pool",
]

_SENT, _RECEIVED = 0, 1


class PartScreen(Protocol):
    """What one all-reduce does with the numbers of its groupmates (one instance per all-reduce)."""

    def sent_part(
        self, sender: PeerID, own: torch.Tensor, part: torch.Tensor, weight: float
    ) -> tuple[torch.Tensor, float]:
        """A sender's part of the slice this peer reduces, and its weight, as they should enter the average."""

    def returned_part(self, reducer: PeerID, own: torch.Tensor, delta: torch.Tensor) -> None:
        """Correct, in place, the averaged delta a remote reducer returned for this peer's part ``own``."""

    def discarded(self) -> int:
        """Elements whose returned average was thrown away (they keep their local values)."""


@dataclass(frozen=True)
class RoundOutcome:
    """What a RoundAverager step returns: the group, and either why it did not average or how much it shared."""

    group_size: int
    skipped: str | None = None  # why this group did not average (then nothing below was done)
    unshared: int = 0  # elements of the slice that no other peer's data reached
    screen: Any = None  # the round's PartScreen, with whatever it recorded
    allreduce_s: float = 0.0  # how long the all-reduce itself took (matchmaking excluded)
    local_parts: range = range(0)  # indices of the parts this peer reduced itself (never compressed)
    peers: tuple[str, ...] = ()  # the group's members (base58 peer ids), this peer included


@dataclass(frozen=True)
class GroupTimeouts:
    """Time bounds for one assembled group's all-reduce (hivemind's allreduce/sender/reducer timeouts)."""

    allreduce_s: float
    sender_s: float
    reducer_s: float


class _MeteredStub:
    """A groupmate's stub whose averaged-part replies are counted as received."""

    def __init__(self, stub: Any, count_received: Callable[[AsyncIterator], AsyncIterator]):
        self._stub, self._count_received = stub, count_received

    async def rpc_aggregate_part(self, inputs: AsyncIterator[averaging_pb2.AveragingData]) -> AsyncIterator:
        return self._count_received(await self._stub.rpc_aggregate_part(inputs))


class _ScreenedPartReducer(TensorPartReducer):
    # upstream has no hook between a sender's part arriving and its accumulation into the average
    def __init__(self, own_parts: Sequence[torch.Tensor], sender_ids: Sequence[PeerID], screen: PartScreen):
        super().__init__(tuple(part.shape for part in own_parts), len(sender_ids))
        self._own_parts, self._sender_ids, self._screen = own_parts, sender_ids, screen

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        if 0 <= part_index < self.num_parts:  # hivemind itself refuses other indices
            tensor_part, weight = self._screen.sent_part(
                self._sender_ids[sender_index], self._own_parts[part_index], tensor_part, weight
            )
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)

    def lonely_elements(self) -> int:
        """Elements of the parts reduced here that fewer than two senders' data reached."""
        # sender_failed_after[i]: the index of the first part sender i failed to deliver (inf: none)
        return sum(
            shape.numel()
            for index, shape in enumerate(self.part_shapes)
            if sum(index < failed_after for failed_after in self.sender_failed_after) < 2
        )


def rebuild_torch_thread_pool() -> None:
    """Call first thing in a forked child that will run torch ops on several threads. The child inherits torch's
    thread pool marked corrupt; the first thread to set its thread count rebuilds it, and two threads doing so at
    once can find none ("Invalid thread pool!": measured in half of such children). Setting the count here rebuilds
    it while this is the only thread (asking for it would not: a forked thread counts as set up already)."""
    torch.set_num_threads(torch.get_num_threads())


def parts_by_reducer(
    container: TensorPartContainer, ordered_peer_ids: Sequence[PeerID], local: torch.Tensor, delta: torch.Tensor
) -> Iterator[tuple[PeerID, torch.Tensor, torch.Tensor]]:
    """(reducer, part of ``local``, part of ``delta``) for every part of a one-tensor all-reduce, in order."""
    # upstream's layout, which it does not expose: parts of part_size_bytes after compression, num_parts_by_peer[i]
    # of them for peer i
    ratio = container.compression.estimate_compression_ratio(container.tensor_infos[0])
    part_values = int(container.part_size_bytes / (local.element_size() * ratio))
    parts = iter(zip(local.view(-1).split(part_values), delta.view(-1).split(part_values), strict=True))
    for peer, count in zip(ordered_peer_ids, container.num_parts_by_peer, strict=True):
        for own, change in (next(parts) for _ in range(count)):
            yield peer, own, change


class ScreenedAllReduce(AllReduceRunner):
    """hivemind's butterfly all-reduce with a PartScreen on both sides and the wire counted in ``traffic``
    (int64 [sent, received]: serialized averaging messages, without libp2p framing and encryption); every message
    it sends waits for ``upload`` (an upload cap) first."""

    def __init__(self, *, traffic: torch.Tensor, screen: PartScreen, upload: UploadPacer | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._traffic, self.screen, self._upload = traffic, screen, upload
        # upstream builds its reducer by name in __init__; the one replaced is marked finished to keep its __del__ quiet
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = _ScreenedPartReducer(self.parts_for_local_averaging, self.sender_peer_ids, screen)

    def screen_returned(self, local: torch.Tensor, delta: torch.Tensor) -> None:
        """Pass every part of ``delta`` that a remote reducer averaged through the screen (in place)."""
        for reducer, own, change in parts_by_reducer(self.tensor_part_container, self.ordered_peer_ids, local, delta):
            if reducer != self.peer_id:  # our own reduction screened every sender already
                self.screen.returned_part(reducer, own, change)

    def local_parts(self) -> range:
        """Indices of the parts this peer reduces itself: upstream neither compresses nor sends them."""
        counts = self.tensor_part_container.num_parts_by_peer
        me = list(self.ordered_peer_ids).index(self.peer_id)
        return range(sum(counts[:me]), sum(counts[: me + 1]))

    def unshared_elements(self) -> int:
        """Elements of this peer's tensor that were not averaged with any other peer.

        Parts whose remote reducer failed come back as zero deltas (upstream counts them in failed_size);
        parts this peer reduced itself count only if at least one other sender's data made it in.
        """
        reducer: _ScreenedPartReducer = self.tensor_part_reducer
        return self.tensor_part_container.failed_size + reducer.lonely_elements() + self.screen.discarded()

    async def _count_received(self, stream: AsyncIterator[averaging_pb2.AveragingData]) -> AsyncIterator:
        async for message in stream:
            self._traffic[_RECEIVED] += message.ByteSize()
            yield message

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        # upstream counts no bytes: the messages this peer sends to each reducer pass here
        async for message in super()._generate_input_for_peer(peer_index):
            await self._paced(message)
            yield message

    def _get_peer_stub(self, peer: PeerID) -> Any:
        # ...and the averaged parts each reducer sends back arrive through its stub
        return _MeteredStub(super()._get_peer_stub(peer), self._count_received)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(self._count_received(stream), context):
            await self._paced(message)
            yield message

    async def _paced(self, message: averaging_pb2.AveragingData) -> None:
        """Count a message this peer sends, once the upload cap (if any) lets it go."""
        size = message.ByteSize()
        if self._upload is not None:
            await self._upload.pace(size)
        self._traffic[_SENT] += size


class RoundAverager(DecentralizedAverager):
    """hivemind's averager for rounds that each have their own group key. Runs in its own process, like its
    parent class; a subclass decides who may join (joiner_refusal), whether an assembled group may average
    (group_refusal) and how groupmates' numbers are screened (new_screen).

    :param buffer: the float32 CPU tensor averaged in place (shared with the averager's process)
    :param layout: bytes that peers slicing their tensors differently differ in: they never match
    :param upload: what every message this peer sends waits for first (an upload cap shared across processes)
    """

    # upstream hands its shared buffer and pipes to its process by fork; keep fork even in a spawned host
    _start_method, _Popen = "fork", staticmethod(mp.get_context("fork").Process._Popen)

    def __init__(
        self, buffer: torch.Tensor, dht: DHT, *, layout: bytes, upload: UploadPacer | None = None, **kwargs: Any
    ):
        super().__init__([buffer], dht, start=False, **kwargs)
        self._upload = upload
        self.schema_hash = hashlib.blake2b(self.schema_hash + layout, digest_size=20).digest()
        self.traffic = torch.zeros(2, dtype=torch.int64).share_memory_()
        # a call sent to the process after its stop is never read, and upstream's step waits for it without a bound
        self._calls, self._stopping = threading.Lock(), False

    def joiner_refusal(self, peer: PeerID, data: Any) -> str | None:
        """As a leader: why ``peer``, which gathered ``data`` for its step, may not join our group (None: it may)."""
        return None

    def group_refusal(self, peer_ids: Sequence[PeerID], members: Sequence[Any]) -> str | None:
        """Why this assembled group may not average (None: it may); every member decides alike on the same data."""
        return None

    def new_screen(self) -> PartScreen:
        raise NotImplementedError

    def group_timeouts(self, members: Sequence[Any]) -> GroupTimeouts | None:
        """Time bounds for the all-reduce of an assembled group, from what its members gathered (None: the ones
        given at construction). Every member computes them from the same data, so the group agrees."""
        return None

    def announce_bandwidth(self, bytes_per_s: float) -> None:
        """The rate this peer announces with its next step: hivemind's load balancing gives a peer a share of the
        parts to reduce in proportion to it."""
        self.bandwidth = bytes_per_s  # upstream reads it in the host process when a step gathers its data

    def reset_traffic(self) -> None:
        self.traffic.zero_()

    def traffic_bytes(self) -> tuple[int, int]:
        """Bytes (sent, received) since reset_traffic."""
        sent, received = self.traffic.tolist()
        return int(sent), int(received)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host process decides when this one ends
        _quiet_round_logs()
        rebuild_torch_thread_pool()  # before hivemind's executor threads compress parts
        super().run()

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        # upstream's version ignores SIGINT in the host process (and fails off the main thread); run() does it here
        self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def set_round(self, group_bits: str, target_group_size: int | None) -> MPFuture:
        """Use this group key, and assemble the group as soon as it has target_group_size peers.

        target_group_size None: at the deadline. CancelledError once the averager is shutting down."""
        with self._calls:
            self._raise_if_stopping()
            self.set_group_bits(group_bits, wait=False)
            future = MPFuture()
            # upstream fixes the target group size at construction; its process takes calls through this pipe
            self._outer_pipe.send(
                ("_set_target_group_size", [], dict(target_group_size=target_group_size, future=future))
            )
            return future

    def begin_step(self, **kwargs: Any) -> StepControl:
        """step(wait=False, **kwargs); CancelledError once the averager is shutting down. A step sent before the
        stop gets its control (the process takes calls in order), so the caller can cancel it."""
        with self._calls:
            self._raise_if_stopping()
            return self.step(wait=False, **kwargs)

    def shutdown(self) -> None:
        with self._calls:  # after a call in flight has been taken, and before any later one is sent
            self._stopping = True
        super().shutdown()

    def _raise_if_stopping(self) -> None:
        if self._stopping:
            raise CancelledError("the averager is shutting down")
        if not self.is_alive():
            raise RuntimeError("hivemind's averager process is not running")

    async def _set_target_group_size(self, target_group_size: int | None, future: MPFuture) -> None:
        self._matchmaking.target_group_size = target_group_size
        future.set_result(None)

    @classmethod
    def user_data(cls, gathered: bytes) -> Any:
        """What a peer passed as ``gather`` to its step (None if a stranger sent something else)."""
        try:  # upstream's layout: serialized [bandwidth, mode, serialized user data]
            return cls.serializer.loads(cls.serializer.loads(gathered)[2])
        except Exception:
            return None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        # upstream's leader takes any joiner with the right group key
        if self.joiner_refusal(context.remote_id, self.user_data(request.gather)) is not None:
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> RoundOutcome:
        # upstream averages with any assembled group and returns only the gathered data from a step
        members = [self.user_data(raw) for raw in group_info.gathered]
        refusal = self.group_refusal(group_info.peer_ids, members)
        if refusal is not None:
            return RoundOutcome(group_info.group_size, skipped=refusal)
        timeouts = self.group_timeouts(members)
        if timeouts is None:
            await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        else:  # upstream fixes these at construction; a group's own bounds replace them (its allreduce_timeout is None)
            kwargs.update(sender_timeout=timeouts.sender_s, reducer_timeout=timeouts.reducer_s)
            await asyncio.wait_for(
                super()._aggregate_with_group(group_info, min_vector_size, **kwargs), timeouts.allreduce_s
            )
        return self._outcome

    async def _shutdown(self, timeout: Optional[float]) -> None:
        # upstream calls finalize() on the futures _running_groups holds (the runner is their result) and waits for
        # what finalize() returns (None): a round in flight at shutdown raised in the averager's thread
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in self._running_groups.values():
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()

    @contextlib.contextmanager
    def tensors_unless(self, stopped: Callable[[], bool], poll_s: float) -> Iterator[Sequence[torch.Tensor]]:
        """get_tensors(), but its wait for the lock ends (CancelledError) once ``stopped()``: an all-reduce holds the
        lock in this averager's process, and a process stopped mid all-reduce never releases it."""
        while not self.lock_averaged_tensors.acquire(timeout=poll_s):
            if stopped():
                raise CancelledError()
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs: Any
    ) -> None:
        # upstream builds AllReduceRunner by name here: its copy, for ScreenedAllReduce (no AUX peers, no alpha)
        group_id = group_info.group_id if group_id is None else group_id
        started = time.monotonic()
        screen = self.new_screen()
        runner = ScreenedAllReduce(
            traffic=self.traffic,
            screen=screen,
            upload=self._upload,
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
            runner.screen_returned(tensor, delta)
            tensor.add_(delta)  # parts whose reducer failed arrive as zero deltas and keep the local value
        self._outcome = RoundOutcome(
            group_info.group_size,
            unshared=runner.unshared_elements(),
            screen=screen,
            allreduce_s=time.monotonic() - started,
            local_parts=runner.local_parts(),
            peers=tuple(peer.to_base58() for peer in group_info.peer_ids),
        )


def found_no_group(error: BaseException) -> bool:
    """Whether a failed step found no group (upstream raises a plain AllreduceException saying so)."""
    return "could not find a group" in str(error)


# upstream logs a failed or partial step with its traceback: the round's own report says it once instead
_ROUND_LOGGERS = (
    "hivemind.averaging.averager",
    "hivemind.averaging.allreduce",
    "hivemind.averaging.partition",
    "hivemind.utils.asyncio",  # tracebacks of matchmaking tasks torn down by a cancelled step
)
_PARTIAL_ROUND_MESSAGES = ("did not finish", "Reducer: received", "Averaging: received")


def _quiet_round_logs() -> None:
    for name in _ROUND_LOGGERS:  # a logger's filter sees only its own records, not its children's
        logging.getLogger(name).addFilter(_reported_by_the_round)
    logging.getLogger("asyncio").addFilter(_not_cancel_noise)


def _reported_by_the_round(record: logging.LogRecord) -> bool:
    if record.exc_info is not None:
        return False
    message = record.getMessage()
    return not any(text in message for text in _PARTIAL_ROUND_MESSAGES)


def _not_cancel_noise(record: logging.LogRecord) -> bool:
    """What asyncio reports when a round is called off (the round reported it already): a step cancelled
    just as its group formed cannot take its result; matchmaking tasks torn down mid-way."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, InvalidStateError) and "CANCELLED" in str(error):
        return False
    if isinstance(error, RuntimeError) and "asynchronous generator is already running" in str(error):
        return False
    return not record.getMessage().startswith("Task was destroyed but it is pending")
