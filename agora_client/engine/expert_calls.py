"""Calls to a worker's moe ConnectionHandler with metadata attached, which hivemind's RemoteExpert cannot send.

Every request carries ``metadata`` in ``ExpertRequest.metadata`` (on the first part of a streamed request);
a payload over the p2p daemon's unary limit is streamed in parts, as hivemind's own client does.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Coroutine, Sequence, TypeVar

import torch
from hivemind import DHT
from hivemind.compression import deserialize_tensor_stream, deserialize_torch_tensor
from hivemind.moe.client.expert import get_server_stub
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter
from hivemind.utils.streaming import split_for_streaming

__all__ = [
    "DEFAULT_MAX_MSG_SIZE",
    "call_expert",
    "call_stream",
    "call_unary",
    "close_replica",
    "replicate_p2p",
    "run_coroutine",
    "server_stub",
]

_T = TypeVar("_T")


def run_coroutine(coroutine: Coroutine[None, None, _T]) -> _T:
    """Run ``coroutine`` in the event loop hivemind's moe clients share, and wait for its result."""
    return RemoteExpertWorker.run_coroutine(coroutine)


def replicate_p2p(dht: DHT) -> P2P:
    """A p2p client of this process on the DHT's daemon, in the moe clients' loop."""
    return run_coroutine(dht.replicate_p2p())


def close_replica(p2p: P2P) -> None:
    """Close a p2p client replicated from a DHT in its own event loop: left to the garbage collector,
    its ``__del__`` runs outside that loop and prints errors."""

    async def shutdown() -> None:
        await p2p.shutdown()
        await asyncio.sleep(0.05)  # the cancelled reader and writer tasks finish

    run_coroutine(shutdown())


def server_stub(p2p: P2P, peer_id: str):
    """The stub of the moe ConnectionHandler at ``peer_id``."""
    return get_server_stub(p2p, PeerID.from_base58(peer_id))


def call_expert(
    stub,
    kind: str,
    uid: str,
    serialized: Sequence[runtime_pb2.Tensor],
    metadata: bytes,
    *,
    payload_bytes: int,
    timeout: float,
) -> list[torch.Tensor]:
    """``kind`` ("forward" or "backward") of ``uid`` at the stub's peer: unary, or streamed above the daemon's
    unary limit; an empty list when the peer's reply ended without an answer."""
    call = call_stream if payload_bytes > MAX_UNARY_PAYLOAD_SIZE else call_unary
    return run_coroutine(asyncio.wait_for(call(stub, kind, uid, serialized, metadata), timeout))


async def call_unary(
    stub, kind: str, uid: str, serialized: Sequence[runtime_pb2.Tensor], metadata: bytes
) -> list[torch.Tensor]:
    """``rpc_forward`` / ``rpc_backward`` of a worker's connection handler, with ``metadata`` attached."""
    request = runtime_pb2.ExpertRequest(uid=uid, tensors=list(serialized), metadata=metadata)
    response = await getattr(stub, f"rpc_{kind}")(request)
    return [deserialize_torch_tensor(tensor) for tensor in response.tensors]


async def call_stream(
    stub,
    kind: str,
    uid: str,
    serialized: Sequence[runtime_pb2.Tensor],
    metadata: bytes,
    part_bytes: int = DEFAULT_MAX_MSG_SIZE,
) -> list[torch.Tensor]:
    """The streamed form, for payloads over the unary limit; ``metadata`` rides on the first part."""
    parts = [part for tensor in serialized for part in split_for_streaming(tensor, part_bytes)]
    requests = [
        runtime_pb2.ExpertRequest(uid=uid, tensors=[part], metadata=metadata if index == 0 else b"")
        for index, part in enumerate(parts)
    ]
    replies = await getattr(stub, f"rpc_{kind}_stream")(iter_as_aiter(requests))
    return await deserialize_tensor_stream(_tensors_of(replies))


async def _tensors_of(replies: AsyncIterator[runtime_pb2.ExpertResponse]) -> AsyncIterator:
    async for reply in replies:
        yield reply.tensors
