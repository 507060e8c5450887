"""Forward and backward calls to a stage's workers over hivemind's moe RPC protocol.

Each stage has its own DHT peer (and p2p daemon) on the trainer, so discovery and traffic of one
stage never queue behind another's. Bytes of every serialized payload are counted per stage, which
is how the boundary traffic is measured.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Sequence

import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor
from hivemind.moe.client.expert import expert_backward, expert_forward, get_server_stub
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID
from hivemind.proto.runtime_pb2 import CompressionType

from agora_client.swarm.roster import WorkerRecord
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


class StageClient:
    """RPCs to the workers of one stage, through that stage's own DHT peer."""

    def __init__(self, stage: str, dht: DHT, traffic: TrafficCounter, timeout: float):
        self.stage, self.dht, self.traffic, self.timeout = stage, dht, traffic, timeout
        self.p2p = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())

    def close(self) -> None:
        """Close the replicated p2p client in its own event loop: left to the garbage collector, its
        ``__del__`` runs outside that loop and prints errors."""

        async def shutdown() -> None:
            await self.p2p.shutdown()
            await asyncio.sleep(0.05)  # the cancelled reader and writer tasks finish

        RemoteExpertWorker.run_coroutine(shutdown())

    def forward(self, worker: WorkerRecord, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self._call(expert_forward, worker, inputs, "forward")

    def backward(
        self, worker: WorkerRecord, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        return self._call(expert_backward, worker, (*inputs, *grad_outputs), "backward")

    def _call(self, method, worker: WorkerRecord, tensors: Sequence[torch.Tensor], kind: str) -> list[torch.Tensor]:
        tensors = tuple(tensor.detach().cpu() for tensor in tensors)
        serialized = [serialize_torch_tensor(tensor, CompressionType.NONE) for tensor in tensors]
        tokens = tensors[0].shape[0] * tensors[0].shape[1]
        self.traffic.add(self.stage, f"{kind}_request", sum(proto.ByteSize() for proto in serialized), tokens)
        stub = get_server_stub(self.p2p, PeerID.from_base58(worker.peer_id))
        outputs = RemoteExpertWorker.run_coroutine(
            asyncio.wait_for(method(worker.uid, tensors, serialized, stub), self.timeout)
        )
        if not outputs:  # a worker killed mid-reply ends the stream without an answer or an error
            raise WorkerVanishedError(f"{worker.uid} returned no tensors")
        reply_bytes = sum(serialize_torch_tensor(out, CompressionType.NONE).ByteSize() for out in outputs)
        self.traffic.add(self.stage, f"{kind}_reply", reply_bytes, tokens)
        return outputs
