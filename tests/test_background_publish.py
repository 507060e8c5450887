"""Publishing never stalls serving (issue 24): a host copy of the state that steps wait for and requests do not,
then the write, in the background, one at a time; a write that fails leaves the previous snapshot in place.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor

from agora_client.config import load_config
from agora_client.engine.expert_calls import call_unary, close_replica, replicate_p2p, run_coroutine, server_stub
from agora_client.events import EventWriter
from agora_client.model import build_stage
from agora_client.model.memory import plan_stage
from agora_client.snapshots import LocalStore, StoredSnapshot, latest_snapshot, load_stage_snapshot
from agora_client.snapshots.background import BackgroundWriter, HostCopy
from agora_client.snapshots.format import StageState, live_state
from agora_client.snapshots.publisher import SnapshotPublisher
from agora_client.worker.epochs import StageLock
from agora_client.worker.main import _warn_if_host_memory_short
from agora_client.worker.node import WorkerNode, WorkerOptions
from agora_client.worker.optimizer import build_optimizer

WAIT_S = 60.0  # bounds a hang only
BATCH, SEQ, WIDTH = 8, 128, 32  # tiny preset: microbatch 8, seq_len 128, boundary = 32 subspace coefficients


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line)

    def flush(self) -> None:
        pass

    def count(self, *parts: str) -> int:
        return sum(all(part in line for part in parts) for line in self.lines)


class HeldStore(LocalStore):
    """A store whose writes wait until the test releases them."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.entered, self.release = threading.Event(), threading.Event()

    def save_state(self, stage: str, state: StageState, epoch: int, **kwargs) -> StoredSnapshot:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the write"
        return super().save_state(stage, state, epoch, **kwargs)


class HeldCopy(HostCopy):
    """Host copies that wait until the test releases them."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def take(self, live: StageState) -> StageState:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the copy"
        return super().take(live)


class FailingStore(LocalStore):
    """A store whose next commit fails as a full disk would, after the files were written."""

    fail = False

    def _commit(self, stage: str, name: str, staging: Path) -> None:
        if self.fail:
            raise OSError(28, "No space left on device")
        super()._commit(stage, name, staging)


def forward(node: WorkerNode) -> torch.Tensor:
    """One forward request sent to the node's server over libp2p, as a trainer sends it."""
    client = DHT(initial_peers=[str(addr) for addr in node.dht.get_visible_maddrs()], start=True, client_mode=True)
    p2p = replicate_p2p(client)
    try:
        inputs = (torch.randn(BATCH, SEQ, WIDTH), torch.randint(0, 256, (BATCH, SEQ)))
        call = call_unary(
            server_stub(p2p, node.peer_id), "forward", node.uid, [serialize_torch_tensor(t) for t in inputs], b""
        )
        return run_coroutine(asyncio.wait_for(call, WAIT_S))[0]
    finally:
        close_replica(p2p)
        client.shutdown()


def take_and_release(lock: StageLock) -> None:
    with lock:
        pass


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_publication_in_the_background_does_not_block_a_forward_or_a_backward(tmp_path) -> None:
    sink = Recorder()
    node = WorkerNode(
        WorkerOptions(load_config("tiny"), "body1", [], index=0, publish_dir=tmp_path, publish_every=1000),
        EventWriter(sink),
    )
    store = node.snapshots.store = HeldStore(tmp_path)
    copy = node.state_writer.copy = HeldCopy()
    try:
        node.start()  # publishes its first snapshot: its host copy is held from here on
        assert copy.entered.wait(WAIT_S), "the first publication never started its copy"
        step = threading.Thread(target=take_and_release, args=(node.epochs.lock,))
        step.start()  # takes the lock as a step does: it waits for the copy...
        assert forward(node).shape == (BATCH, SEQ, WIDTH)  # ...and requests are served meanwhile
        assert node.epochs.lock.training.acquire(timeout=WAIT_S)  # what a backward takes: free
        node.epochs.lock.training.release()
        assert step.is_alive(), "the step waits for the copy"
        copy.release.set()
        step.join(WAIT_S)
        assert not step.is_alive()
        assert store.entered.wait(WAIT_S), "the copy never reached the store"
        assert forward(node).shape == (BATCH, SEQ, WIDTH) and node.state_writer.busy and not store.release.is_set()
        assert node.epochs.lock.state.acquire(timeout=WAIT_S)  # the write itself holds no lock
        node.epochs.lock.state.release()
        assert not node.snapshots.publish(1) and not node.snapshots.publish(2)  # due while one is in flight
        assert sink.count('"SNAPSHOT"', "skipped the body1 snapshot", '"warning"') == 1  # a run of skips is said once
        store.release.set()
        assert node.state_writer.wait(WAIT_S)
        assert [snapshot.epoch for snapshot in store.list("body1")] == [0]
        assert sink.count("published the body1 snapshot", "steps wait for the copy, requests do not") == 1
    finally:
        copy.release.set()
        store.release.set()
        node.shutdown()


def test_a_failed_background_write_keeps_the_previous_snapshot_and_is_reported(tmp_path) -> None:
    config = load_config("tiny")
    module = build_stage(config.model, "body1", seed=1)
    optimizer = build_optimizer(list(module.parameters()), config)
    sink, store = Recorder(), FailingStore(tmp_path)
    writer = BackgroundWriter(module, optimizer, threading.Lock())
    publisher = SnapshotPublisher(store, "body1", writer, keep=3, events=EventWriter(sink))
    assert publisher.publish(3) and writer.wait(WAIT_S)
    published = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(1.0)  # the state a failed write would have held
    store.fail = True
    assert publisher.publish(4) and writer.wait(WAIT_S)
    assert sink.count('"level":"error"', '"SNAPSHOT"', "body1 snapshot of epoch 4", "No space left") == 1
    assert sink.count('"kind":"error"', '"where":"snapshot publication"', "No space left") == 1
    assert [snapshot.epoch for snapshot in store.list("body1")] == [3]
    assert not [entry for entry in (tmp_path / "body1").iterdir() if entry.name.startswith(".tmp")]  # no staging left
    restored = build_stage(config.model, "body1", seed=2)
    assert load_stage_snapshot(latest_snapshot(tmp_path / "body1"), restored).epoch == 3
    assert all(torch.equal(restored.state_dict()[name], tensor) for name, tensor in published.items())
    store.fail = False
    assert publisher.publish(5) and writer.wait(WAIT_S)  # the buffers are free again: the next one is written
    assert [snapshot.epoch for snapshot in store.list("body1")] == [3, 5]


class WatchedCopy(HostCopy):
    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self.lock, self.held_while_copying = lock, []

    def take(self, live: StageState) -> StageState:
        self.held_while_copying.append(self.lock.locked())
        return super().take(live)


def test_the_host_copy_is_taken_under_the_state_lock_into_reused_buffers() -> None:
    config = load_config("tiny")
    module = build_stage(config.model, "body1", seed=1)
    optimizer = build_optimizer(list(module.parameters()), config)
    for parameter in module.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # the moments exist from the first step on
    lock, written = threading.Lock(), []
    writer = BackgroundWriter(module, optimizer, lock)
    writer.copy = copy = WatchedCopy(lock)

    def failed(what: str, error: Exception) -> None:
        raise AssertionError(f"{what}: {error}")

    for what in ("first", "second"):
        assert writer.submit(what, written.append, failed) and writer.wait(WAIT_S)
    assert copy.held_while_copying == [True, True] and not lock.locked()  # the write itself ran without the lock
    first, second = written
    live = module.state_dict()
    for key, tensor in first.params.items():
        assert tensor.data_ptr() == second.params[key].data_ptr()  # the same host buffers, not new ones
        assert tensor.data_ptr() != live[key].data_ptr() and torch.equal(tensor, live[key])  # a copy, not a view
    moments = live_state(module, optimizer).optimizer
    assert first.optimizer.keys() == moments.keys() and any(key.endswith("exp_avg_sq") for key in moments)
    for key, tensor in first.optimizer.items():
        assert tensor.data_ptr() != moments[key].data_ptr() and torch.equal(tensor, moments[key])
    held = sum(tensor.numel() * tensor.element_size() for tensor in [*first.params.values(), *first.optimizer.values()])
    planned = plan_stage(config, "body1")
    assert (
        planned.snapshot <= held <= planned.snapshot * 1.01
    )  # the plan's "+ writing" host memory (step counters aside)


def test_an_operators_worker_says_when_the_host_lacks_memory_for_its_state_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = WorkerOptions(load_config("tiny"), "body1", [], publish_dir="snapshots")
    plan = plan_stage(options.config, "body1")
    for available, warned in (
        (plan.host_need(False, writes_state=True) - 1, 1),
        (10 * plan.host_need(False, writes_state=True), 0),
    ):
        sink = Recorder()
        monkeypatch.setattr(psutil, "virtual_memory", lambda available=available: SimpleNamespace(available=available))
        _warn_if_host_memory_short(options, EventWriter(sink))
        assert sink.count('"warning"', "stage body1 needs", "with the host copy of its state") == warned
