"""The worker's hivemind moe Server, with two seams swapped in (through agora_client/engine/serving.py).

- Connection handlers check every request's ticket, size, schema and values before it reaches a pool,
  count every answered request and its payload bytes (serving/traffic.py), and hold each answer until the
  worker's upload cap lets it go (agora_client/upload_cap.py).
- The DHT handler thread is replaced by the StageAnnouncer, which publishes the stage-prefixed uid
  together with the sync phase (hivemind's own handler can only publish the uid).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing as mp
import threading
from multiprocessing.sharedctypes import Synchronized
from typing import AsyncIterator, Callable, Iterator, Sequence

import torch
from hivemind import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import nested_flatten
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.discovery.roster import WorkerRecord, announce, withdraw
from agora_client.engine.serving import CheckedConnectionHandler, HostedServer
from agora_client.serving.backend import StageBackend, WorkerUnhealthy, WorkerYielding
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.ticket_gate import TicketGate
from agora_client.serving.traffic import RequestMeter
from agora_client.serving.validation import (
    BadRequest,
    DescriptorCheck,
    MagnitudeGuard,
    RequestRejected,
    check_descriptors,
    validate_inputs,
)
from agora_client.upload_cap import UploadCap

_HEAR_OUT_S = 3.0  # how long a refused stream is still read so that its caller hears why


class GuardedConnectionHandler(CheckedConnectionHandler):
    """hivemind's handler with every request checked in order, each step before the next is paid for:
    ticket (nothing else read yet) -> this worker's health -> declared sizes, shapes and dtypes
    (before the payload is deserialized) -> values (before the request reaches a pool)."""

    def __init__(
        self,
        dht: DHT,
        backends: dict[str, StageBackend],
        *,
        vocab_size: int,
        max_request_batch: int,
        gate: TicketGate | None,
        rejections: RejectionLog,
        healthy: Synchronized,
        yielding: Synchronized,
        meter: RequestMeter | None = None,
        upload: UploadCap | None = None,
    ):
        super().__init__(dht, backends)
        self._schemas: dict[tuple[str, str], tuple[BatchTensorDescriptor, ...]] = {}
        self._pools: dict[str, tuple[str, str]] = {}
        for uid, backend in backends.items():
            for kind, pool, schema in (
                ("forward", backend.forward_pool, backend.forward_schema),
                ("backward", backend.backward_pool, backend.backward_schema),
            ):
                self._schemas[uid, kind] = tuple(nested_flatten(schema))
                self._pools[pool.name] = (uid, kind)
        self._largest_request = max(
            DescriptorCheck(schema, max_request_batch).largest_request_bytes() for schema in self._schemas.values()
        )
        self._magnitudes = {kind: MagnitudeGuard(kind) for kind in ("forward", "backward")}
        self._vocab_size, self._max_request_batch = vocab_size, max_request_batch
        self._gate, self._rejections, self._healthy, self._yielding = gate, rejections, healthy, yielding
        self._meter, self._upload = meter, upload

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        with self._refusals(context):
            self._admit(request, context, "forward")
            check_descriptors(request.tensors, self._schemas[request.uid, "forward"], self._max_request_batch)
            return await super().rpc_forward(request, context)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        with self._refusals(context):
            self._admit(request, context, "backward")
            check_descriptors(request.tensors, self._schemas[request.uid, "backward"], self._max_request_batch)
            return await super().rpc_backward(request, context)

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self._refusals(context):
            async with self._heard_out(requests):
                async for reply in super().rpc_forward_stream(
                    self._checked_stream(requests, context, "forward"), context
                ):
                    yield reply

    async def rpc_backward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self._refusals(context):
            async with self._heard_out(requests):
                async for reply in super().rpc_backward_stream(
                    self._checked_stream(requests, context, "backward"), context
                ):
                    yield reply

    @contextlib.asynccontextmanager
    async def _heard_out(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> AsyncIterator[None]:
        """On an error, read what is left of the request before it is answered: closing a stream the caller
        still writes to loses the error on its way (the caller sees an empty reply or a broken pipe). At most
        the largest request this worker takes, for at most a few seconds; a caller sending more or for longer
        still loses it."""
        try:
            yield
        except Exception:
            budget = self._largest_request
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_HEAR_OUT_S):
                    async for request in requests:
                        budget -= request.ByteSize()
                        if budget < 0:
                            break
            raise

    async def _checked_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext, kind: str
    ) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        """The parts of a streamed request, each checked before hivemind deserializes it.

        The ticket is on the first."""
        check: DescriptorCheck | None = None
        async for request in requests:
            if check is None:
                self._admit(request, context, kind)
                check = DescriptorCheck(self._schemas[request.uid, kind], self._max_request_batch)
            check.feed(request.tensors)
            yield request
        if check is None:
            raise BadRequest("the request stream ended before its first part")
        check.finish()

    def _admit(self, request: runtime_pb2.ExpertRequest, context: P2PContext, kind: str) -> None:
        if self._gate is not None:
            self._gate.check(request.metadata, context.remote_id.to_base58())
        if not self._healthy.value:
            raise WorkerUnhealthy(WorkerUnhealthy.MESSAGE)
        if self._yielding.value:  # requests admitted before the yield still finish
            raise WorkerYielding(WorkerYielding.MESSAGE)
        if (request.uid, kind) not in self._schemas:
            raise KeyError(f"this worker serves {sorted(self.module_backends)}, not {request.uid!r}")

    @contextlib.contextmanager
    def _refusals(self, context: P2PContext) -> Iterator[None]:
        try:
            yield
        except RequestRejected as error:
            self._rejections.report(context.remote_id.to_base58(), error.reason, str(error))
            raise

    def check_inputs(self, pool_name: str, inputs: Sequence[torch.Tensor]) -> None:
        uid, kind = self._pools[pool_name]
        validate_inputs(
            inputs, self._schemas[uid, kind], vocab_size=self._vocab_size, max_batch_size=self._max_request_batch
        )
        self._magnitudes[kind].check(inputs)

    def answered(self, pool_name: str, inputs: Sequence[torch.Tensor], outputs: Sequence[runtime_pb2.Tensor]) -> None:
        if self._meter is not None:  # every answered request, whichever rpc (plain or streamed) carried it
            received = sum(tensor.numel() * tensor.element_size() for tensor in inputs)
            self._meter.on_request(self._pools[pool_name][1], received, sum(proto.ByteSize() for proto in outputs))

    async def before_answer(self, outputs: Sequence[runtime_pb2.Tensor]) -> None:
        if self._upload is not None:
            await self._upload.pace(sum(proto.ByteSize() for proto in outputs))


class StageAnnouncer(threading.Thread):
    """Re-publishes this worker's WorkerRecord every ``period`` seconds; withdraws it on stop."""

    def __init__(self, dht: DHT, record: Callable[[], WorkerRecord], period: float):
        super().__init__(name="stage-announcer", daemon=True)
        self.dht, self.record, self.period = dht, record, period
        self.stop = threading.Event()
        self.refresh = threading.Event()  # set to announce now (e.g. after a sync phase change)

    def run(self) -> None:
        while not self.stop.is_set():
            announce(self.dht, self.record(), ttl=self.period * 2.5)
            self.refresh.wait(self.period)
            self.refresh.clear()
        withdraw(self.dht, self.record(), ttl=self.period * 2.5)

    def join(self, timeout: float | None = None) -> None:
        self.refresh.set()
        super().join(timeout)


class StageServer(HostedServer):
    """One stage served through GuardedConnectionHandlers, announced by a StageAnnouncer."""

    def __init__(
        self,
        dht: DHT,
        backend: StageBackend,
        record: Callable[[], WorkerRecord],
        *,
        announce_period: float,
        vocab_size: int,
        max_request_batch: int,
        gate: TicketGate | None,
        rejections: RejectionLog,
        num_connection_handlers: int = 2,
        meter: RequestMeter | None = None,
        upload: UploadCap | None = None,
        **runtime_kwargs,
    ):
        healthy = mp.get_context("fork").Value(ctypes.c_bool, True)  # shared with the forked handlers
        yielding = mp.get_context("fork").Value(ctypes.c_bool, False)
        announcer = StageAnnouncer(dht, record, announce_period)
        super().__init__(
            dht,
            {backend.name: backend},
            handlers=lambda backends: [
                GuardedConnectionHandler(
                    dht,
                    backends,
                    vocab_size=vocab_size,
                    max_request_batch=max_request_batch,
                    gate=gate,
                    rejections=rejections,
                    healthy=healthy,
                    yielding=yielding,
                    meter=meter,
                    upload=upload,
                )
                for _ in range(num_connection_handlers)
            ],
            announcer=announcer,
            **runtime_kwargs,
        )
        self.healthy, self.yielding, self.announcer = healthy, yielding, announcer
