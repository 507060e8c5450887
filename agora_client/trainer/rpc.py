"""Forward and backward calls to a stage's workers over hivemind's moe RPC protocol.

Each stage has its own DHT peer (and p2p daemon) on the trainer, so discovery and traffic of one
stage never queue behind another's. Bytes of every serialized payload are counted per stage, which
is how the boundary traffic is measured.

Every request carries the trainer's ticket for the calling peer in hivemind's ``ExpertRequest.metadata``
(on the first part of a streamed request), which workers check before reading anything else; hivemind's
``expert_forward`` / ``expert_backward`` cannot attach metadata, hence the two small calls below.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Sequence

import torch
from hivemind import DHT
from hivemind.compression import deserialize_tensor_stream, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.moe.client.expert import get_server_stub
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind.utils.asyncio import iter_as_aiter
from hivemind.utils.streaming import split_for_streaming

from agora_client.auth.ticket_source import TicketSource
from agora_client.discovery.roster import WorkerRecord
from agora_client.trainer.errors import WorkerVanishedError


class TrafficCounter:
    """Serialized bytes sent and received per (stage, direction), plus the tokens they carried."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.tokens: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, stage: str, direction: str, nbytes: int, tokens: int) -> None:
        with self._lock:
            self.bytes[stage, direction] += nbytes
            self.tokens[stage, direction] += tokens

    def per_token(self) -> dict[str, float]:
        """Serialized bytes per token for every ``<stage>.<kind>_<request|reply>`` seen so far."""
        with self._lock:
            return {
                f"{stage}.{direction}": round(self.bytes[stage, direction] / tokens, 3)
                for (stage, direction), tokens in self.tokens.items()
                if tokens
            }


def close_replica(p2p: P2P) -> None:
    """Close a p2p client replicated from a DHT in its own event loop: left to the garbage collector,
    its ``__del__`` runs outside that loop and prints errors."""

    async def shutdown() -> None:
        await p2p.shutdown()
        await asyncio.sleep(0.05)  # the cancelled reader and writer tasks finish

    RemoteExpertWorker.run_coroutine(shutdown())


class StageClient:
    """RPCs to the workers of one stage, through that stage's own DHT peer."""

    def __init__(self, stage: str, dht: DHT, traffic: TrafficCounter, timeout: float, tickets: TicketSource | None = None):
        self.stage, self.dht, self.traffic, self.timeout, self.tickets = stage, dht, traffic, timeout, tickets
        self.p2p = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())
        self.peer_id = self.p2p.peer_id.to_base58()

    def close(self) -> None:
        close_replica(self.p2p)

    def forward(self, worker: WorkerRecord, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self._call(worker, inputs, "forward")

    def backward(
        self, worker: WorkerRecord, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        return self._call(worker, (*inputs, *grad_outputs), "backward")

    def _call(self, worker: WorkerRecord, tensors: Sequence[torch.Tensor], kind: str) -> list[torch.Tensor]:
        tensors = tuple(tensor.detach().cpu() for tensor in tensors)
        serialized = [serialize_torch_tensor(tensor, CompressionType.NONE) for tensor in tensors]
        tokens = tensors[0].shape[0] * tensors[0].shape[1]
        self.traffic.add(self.stage, f"{kind}_request", sum(proto.ByteSize() for proto in serialized), tokens)
        stub = get_server_stub(self.p2p, PeerID.from_base58(worker.peer_id))
        metadata = self.tickets.ticket_for(self.peer_id).encode("ascii") if self.tickets is not None else b""
        streamed = sum(tensor.element_size() * tensor.nelement() for tensor in tensors) > MAX_UNARY_PAYLOAD_SIZE
        call = call_stream if streamed else call_unary
        outputs = RemoteExpertWorker.run_coroutine(
            asyncio.wait_for(call(stub, kind, worker.uid, serialized, metadata), self.timeout)
        )
        if not outputs:  # a worker killed mid-reply ends the stream without an answer or an error
            raise WorkerVanishedError(f"{worker.uid} returned no tensors")
        reply_bytes = sum(serialize_torch_tensor(out, CompressionType.NONE).ByteSize() for out in outputs)
        self.traffic.add(self.stage, f"{kind}_reply", reply_bytes, tokens)
        return outputs


async def call_unary(
    stub, kind: str, uid: str, serialized: Sequence[runtime_pb2.Tensor], metadata: bytes
) -> list[torch.Tensor]:
    """``rpc_forward`` / ``rpc_backward`` of a worker's connection handler, with ``metadata`` attached."""
    request = runtime_pb2.ExpertRequest(uid=uid, tensors=list(serialized), metadata=metadata)
    response = await getattr(stub, f"rpc_{kind}")(request)
    return [deserialize_torch_tensor(tensor) for tensor in response.tensors]


async def call_stream(
    stub, kind: str, uid: str, serialized: Sequence[runtime_pb2.Tensor], metadata: bytes,
    part_bytes: int = DEFAULT_MAX_MSG_SIZE,
) -> list[torch.Tensor]:
    """The streamed form, for payloads over hivemind's unary limit; ``metadata`` rides on the first part."""
    parts = [part for tensor in serialized for part in split_for_streaming(tensor, part_bytes)]
    requests = [
        runtime_pb2.ExpertRequest(uid=uid, tensors=[part], metadata=metadata if index == 0 else b"")
        for index, part in enumerate(parts)
    ]
    replies = await getattr(stub, f"rpc_{kind}_stream")(iter_as_aiter(requests))
    return await deserialize_tensor_stream(_tensors_of(replies))


async def _tensors_of(replies):
    async for reply in replies:
        yield reply.tensors
