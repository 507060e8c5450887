"""A worker whose weights break leaves routing and comes back only after reloading a peer's snapshot (issue 12).

An in-process WorkerNode on its own DHT (no seeds): its weights are made non-finite through the
optimizer step guard, as a bad update would; the node must say so, publish itself unhealthy, reload
the stage snapshot a healthy peer published, and re-enter sync phase 1 before trainers route to it again.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from agora_client.auth.ticket_source import SelfIssuedTickets
from agora_client.auth.tickets import generate_signing_key, public_key_text
from agora_client.config import load_config
from agora_client.events import EventWriter
from agora_client.model import build_stage
from agora_client.snapshots import latest_snapshot, save_stage_snapshot
from agora_client.worker.node import WorkerNode, WorkerOptions
from agora_client.worker.optimizer import build_optimizer
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class Recorder:
    def __init__(self):
        self.events = []

    def write(self, line: str) -> None:
        self.events.append(line)

    def flush(self) -> None:
        pass


def test_broken_weights_take_the_worker_out_of_routing_until_it_reloaded(tmp_path) -> None:
    config = load_config("tiny")
    peer = build_stage(config.model, "body1", seed=1)  # a healthy peer's published state
    peer_optimizer = build_optimizer(list(peer.parameters()), config)  # the optimizer every worker of the run builds
    save_stage_snapshot(tmp_path, "body1", peer, peer_optimizer, epoch=3, keep=1)
    sink = Recorder()
    node = WorkerNode(
        WorkerOptions(config, "body1", [], index=0, recovery=lambda: latest_snapshot(tmp_path / "body1")),
        EventWriter(sink),
    )
    try:
        node.start()
        assert node.record().healthy and node.record().routable
        node.epochs.optimizer = torch.optim.SGD(node.parameters, lr=math.inf)  # a step that breaks every weight
        for parameter in node.parameters:
            parameter.grad = torch.ones_like(parameter)
        node.epochs.local_samples = 1
        with node.epochs.lock:
            node.epochs._step()
        assert any('"where":"worker health"' in line and "turned non-finite" in line for line in sink.events)
        wait_until(lambda: node.healthy, 30, "the reload of the peer's snapshot", poll=0.2)
        record = node.record()
        assert record.healthy and record.sync_phase == 1 and not record.routable  # re-syncing before serving again
        expected = dict(peer.named_parameters())
        assert all(torch.equal(p.detach(), expected[name].detach()) for name, p in node.module.named_parameters())
        assert any("reloaded the body1 snapshot of epoch 3" in line for line in sink.events)
    finally:
        node.shutdown()


def test_without_a_snapshot_source_it_stays_out_of_routing(tmp_path) -> None:
    config = load_config("tiny")
    sink = Recorder()
    node = WorkerNode(WorkerOptions(config, "body1", [], index=0), EventWriter(sink))
    try:
        node.start()
        node.mark_unhealthy("its forward outputs turned non-finite on finite inputs")
        assert not node.record().healthy and not node.record().routable
        wait_until(
            lambda: any("restart this worker to rejoin" in line for line in sink.events), 10, "the warning", poll=0.2
        )
        assert not node.healthy
    finally:
        node.shutdown()


def test_a_worker_checking_tickets_without_one_of_its_own_says_it_cannot_average_and_stops_before_start() -> None:
    config, key = load_config("tiny"), generate_signing_key()
    for tickets, warned in ((None, True), (SelfIssuedTickets(key, role="worker", stage="body1"), False)):
        sink = Recorder()
        node = WorkerNode(
            WorkerOptions(config, "body1", [], index=0, auth_public_key=public_key_text(key), tickets=tickets),
            EventWriter(sink),
        )
        node.shutdown()  # as a contributor stopped between building its worker and starting it
        assert not node.dht.is_alive()
        assert any("will not average with it" in line for line in sink.events) == warned, sink.events


def test_a_worker_whose_server_thread_dies_leaves_and_returns_1(capsys) -> None:
    """hivemind's server thread runs every request, and an error in it ends it (and shuts hivemind's server down):
    the worker must not stay up answering nothing. The error is the one the rehearsal saw under load, raised where
    it was raised: in the runtime's batch iterator."""
    from agora_client.worker.main import _serve_until_stopped

    node = WorkerNode(WorkerOptions(load_config("tiny"), "body1", [], index=0), EventWriter(Recorder()))
    fail = threading.Event()

    def failing_batches(*args, **kwargs):
        fail.wait(120)
        raise RuntimeError("Shared memory manager connection has timed out")
        yield

    node.server.runtime.iterate_minibatches_from_pools = failing_batches
    stop, codes = threading.Event(), []
    serving = threading.Thread(target=lambda: codes.append(_serve_until_stopped(node, stop)))
    serving.start()
    try:
        wait_until(lambda: "ready on peer" in capsys.readouterr().out or codes, 120, "the worker to serve", poll=0.2)
        assert node.serving
        fail.set()
        serving.join(timeout=120)
        assert codes == [1]
    finally:
        fail.set()
        stop.set()
        serving.join(timeout=60)
    assert "hivemind's server thread stopped (its error is above)" in capsys.readouterr().err
