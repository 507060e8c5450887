"""A worker's answers to trainers wait for its upload cap (--max-upload-mbit), in its forked connection handlers.

An in-process WorkerNode capped at 2 Mbit/s (250 KB/s, half a second's worth in its bucket), called over libp2p
as a trainer calls it: every answer takes its bytes from the worker's one bucket, and answers of ~1 MB in all take
no less than the ~4 s the cap allows.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor

from agora_client.config import load_config
from agora_client.engine.expert_calls import call_unary, close_replica, replicate_p2p, run_coroutine, server_stub
from agora_client.events import EventWriter
from agora_client.upload_cap import BURST_S, WIRE_OVERHEAD
from agora_client.worker.node import WorkerNode, WorkerOptions
from tests.swarm_helpers import wait_until
from tests.test_worker_yield import SEQ, WAIT_S, WIDTH, Sink, listed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
CAP_MBIT = 2.0
BATCH = 8  # tiny's microbatch: 128 KB an answer
REQUESTS = 8


def forward(node: WorkerNode, p2p) -> None:
    inputs = (torch.randn(BATCH, SEQ, WIDTH), torch.randint(0, 256, (BATCH, SEQ)))
    call = call_unary(
        server_stub(p2p, node.peer_id), "forward", node.uid, [serialize_torch_tensor(t) for t in inputs], b""
    )
    assert run_coroutine(asyncio.wait_for(call, WAIT_S))[0].shape[0] == BATCH


def test_answers_leave_no_faster_than_the_cap() -> None:
    node = WorkerNode(
        WorkerOptions(load_config("tiny"), "body1", [], index=0, max_upload_mbit=CAP_MBIT), EventWriter(Sink())
    )
    client = p2p = None
    try:
        node.start()
        client = DHT(initial_peers=[str(addr) for addr in node.dht.get_visible_maddrs()], start=True, client_mode=True)
        p2p = replicate_p2p(client)
        wait_until(lambda: (record := listed(node, client)) is not None and record.routable, 30, "the worker's record")
        forward(node, p2p)  # the first answer: connections set up
        time.sleep(BURST_S * 2)  # the bucket fills up again: the burst counts in the bound below
        before, paced, started = node.meter.totals().bytes_out, node.upload.paced_bytes, time.monotonic()
        for _ in range(REQUESTS):
            forward(node, p2p)
        elapsed, sent = time.monotonic() - started, node.meter.totals().bytes_out - before
        assert node.upload.paced_bytes - paced == sent  # every answer, from the forked handlers, took its bytes
        cap = node.upload.bytes_per_s
        assert sent > 4 * cap * BURST_S  # the answers are far more than the bucket holds
        least = (sent * WIRE_OVERHEAD - cap * BURST_S) / cap  # what the cap allows, the bucket's burst first
        assert elapsed >= 0.95 * least, (
            f"{sent:,} bytes answered in {elapsed:.2f}s; the cap allows no less than {least:.2f}s"
        )
    finally:
        if p2p is not None:
            close_replica(p2p)
        if client is not None:
            client.shutdown()
        node.shutdown()
