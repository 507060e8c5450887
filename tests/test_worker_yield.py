"""A worker told to yield the GPU to its owner drains and comes back (issue 30, part 6).

An in-process WorkerNode on its own DHT, called over libp2p as a trainer calls it: while yielding, the DHT's
roster marks it out of routing and a new request is refused with what trainers read as "send it elsewhere";
once it resumes, the roster routes to it again and the same request is served.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2PHandlerError

from agora_client.config import load_config
from agora_client.discovery.roster import fetch_roster
from agora_client.engine.expert_calls import call_unary, close_replica, replicate_p2p, run_coroutine, server_stub
from agora_client.events import EventWriter
from agora_client.trainer.errors import ErrorClass, classify
from agora_client.worker.node import WorkerNode, WorkerOptions
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
WAIT_S = 60.0  # bounds a hang only
BATCH, SEQ, WIDTH = 1, 128, 32  # tiny preset: seq_len 128, the boundary is 32 subspace coefficients


class Sink:
    def write(self, line: str) -> None:
        pass

    def flush(self) -> None:
        pass


def forward(node: WorkerNode, p2p) -> torch.Tensor:
    inputs = (torch.randn(BATCH, SEQ, WIDTH), torch.randint(0, 256, (BATCH, SEQ)))
    call = call_unary(
        server_stub(p2p, node.peer_id), "forward", node.uid, [serialize_torch_tensor(t) for t in inputs], b""
    )
    return run_coroutine(asyncio.wait_for(call, WAIT_S))[0]


def listed(node: WorkerNode, client: DHT):
    return fetch_roster(client, "body1").get(node.peer_id)


def test_a_yielding_worker_leaves_routing_refuses_new_requests_and_comes_back() -> None:
    node = WorkerNode(WorkerOptions(load_config("tiny"), "body1", [], index=0), EventWriter(Sink()))
    client = p2p = None
    try:
        node.start()
        client = DHT(initial_peers=[str(addr) for addr in node.dht.get_visible_maddrs()], start=True, client_mode=True)
        p2p = replicate_p2p(client)  # one trainer's connection for every call
        wait_until(lambda: (record := listed(node, client)) is not None and record.routable, 30, "the worker's record")
        assert forward(node, p2p).shape[0] == BATCH

        node.yield_gpu()
        wait_until(lambda: listed(node, client).yielding, 30, "the roster to say it yields", poll=0.2)
        assert not listed(node, client).routable  # trainers route around it; it keeps its record (and uid)
        with pytest.raises(P2PHandlerError) as refused:
            forward(node, p2p)
        assert "yields its GPU" in str(refused.value) and classify(refused.value) is ErrorClass.RETRY_OTHER

        node.resume()
        wait_until(lambda: listed(node, client).routable, 30, "the roster to route to it again", poll=0.2)
        assert node.sync.phase == 0  # no epoch passed while it yielded: no re-sync needed
        assert forward(node, p2p).shape[0] == BATCH
    finally:
        if p2p is not None:
            close_replica(p2p)
        if client is not None:
            client.shutdown()
        node.shutdown()
