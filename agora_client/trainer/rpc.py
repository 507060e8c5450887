"""Forward and backward calls to a stage's workers over hivemind's moe RPC protocol.

Each stage has its own DHT peer (and p2p daemon) on the trainer, so discovery and traffic of one
stage never queue behind another's. Bytes of every serialized payload are counted per stage, which
is how the boundary traffic is measured.

Every request carries the trainer's ticket for the calling peer in hivemind's ``ExpertRequest.metadata``
(on the first part of a streamed request), which workers check before reading anything else
(agora_client/engine/expert_calls.py: hivemind's ``expert_forward`` / ``expert_backward`` cannot attach it).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Sequence

import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

from agora_client.auth.ticket_source import TicketSource
from agora_client.discovery.roster import WorkerRecord
from agora_client.engine.expert_calls import call_expert, close_replica, replicate_p2p, server_stub
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

    def __init__(
        self, stage: str, dht: DHT, traffic: TrafficCounter, timeout: float, tickets: TicketSource | None = None
    ):
        self.stage, self.dht, self.traffic, self.timeout, self.tickets = stage, dht, traffic, timeout, tickets
        self.p2p = replicate_p2p(dht)
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
        metadata = self.tickets.ticket_for(self.peer_id).encode("ascii") if self.tickets is not None else b""
        payload_bytes = sum(tensor.element_size() * tensor.nelement() for tensor in tensors)
        outputs = call_expert(
            server_stub(self.p2p, worker.peer_id),
            kind,
            worker.uid,
            serialized,
            metadata,
            payload_bytes=payload_bytes,
            timeout=self.timeout,
        )
        if not outputs:  # a worker killed mid-reply ends the stream without an answer or an error
            raise WorkerVanishedError(f"{worker.uid} returned no tensors")
        reply_bytes = sum(serialize_torch_tensor(out, CompressionType.NONE).ByteSize() for out in outputs)
        self.traffic.add(self.stage, f"{kind}_reply", reply_bytes, tokens)
        return outputs
