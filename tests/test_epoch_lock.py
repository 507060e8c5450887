"""A stage epoch's step and the tracker's DHT reads: hivemind's ProgressTracker holds its lock through each read
of the stage's progress (slow under load), and a step must wait for that without holding up requests."""

from __future__ import annotations

import threading

import pytest
import torch
from hivemind import DHT

from agora_client.config import SyncConfig
from agora_client.worker.epochs import EpochController
from agora_client.worker.sync import SyncState


class WatchedLock:
    """A lock that says when the epoch thread starts waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch_thread_waits = threading.Event()

    def acquire(self, *args, **kwargs) -> bool:
        if threading.current_thread().name.startswith("epochs-"):
            self.epoch_thread_waits.set()
        return self._lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@pytest.fixture(scope="module")
def dht():
    node = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def test_requests_go_on_while_a_step_waits_for_the_trackers_dht_read(dht: DHT) -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    stepped = threading.Event()
    epochs = EpochController(
        dht,
        "epochlock",
        [weight],
        torch.optim.SGD([weight], lr=0.1),
        target_batch_size=1,
        clip_norm=100.0,
        sync=SyncState(SyncConfig(), lambda event: None, joining=False),
        on_epoch=lambda epoch: stepped.set(),
        on_error=pytest.fail,
        on_skipped_step=pytest.fail,
        on_corrupt_weights=pytest.fail,
    )
    reading = WatchedLock()
    epochs.tracker.lock_global_progress = reading
    epochs.start()
    try:
        with reading:  # the tracker's fetcher, in the middle of a DHT read
            with epochs.lock.training:  # a backward: its sample fills the stage batch, the step is due
                weight.grad = torch.ones(3)
                epochs.on_samples(1)
            assert reading.epoch_thread_waits.wait(30), "the step never came"
            # the step waits for the read; a request meanwhile gets the training lock
            assert epochs.lock.training.acquire(timeout=10), "the waiting step holds up requests"
            epochs.lock.training.release()
            assert not stepped.is_set()
        assert stepped.wait(30), "the step did not happen once the read was over"
        torch.testing.assert_close(weight.detach(), torch.full((3,), -0.1))
    finally:
        epochs.shutdown()
