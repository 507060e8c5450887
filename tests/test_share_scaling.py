"""A worker's step scaled by its share of the stage epoch's samples (optim.share_scaling, worker/epochs.py)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hivemind import DHT

from agora_client.config import ConfigError, SyncConfig, load_config
from agora_client.worker.epochs import EpochController, scaled_lr, step_scale
from agora_client.worker.optimizer import OffloadAdamW
from agora_client.worker.sync import SyncState

LR = 0.1
GRAD = torch.tensor([1.0, -2.0, 0.5])


@pytest.mark.parametrize(
    "mode, share, scale",
    [
        ("none", 0.25, 1.0),
        ("linear", 0.25, 0.25),
        ("sqrt", 0.25, 0.5),
        ("linear", None, 1.0),
        ("sqrt", 1.0, 1.0),
    ],
)
def test_the_scale_follows_the_mode_and_the_share(mode: str, share: float | None, scale: float) -> None:
    assert step_scale(mode, share) == scale


@pytest.mark.parametrize("mode", ["none", "linear", "sqrt"])
def test_an_sgd_step_moves_by_lr_times_scale_times_gradient_and_the_lr_comes_back(mode: str) -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=LR)
    weight.grad = GRAD.clone()
    scale = step_scale(mode, 0.36)
    with scaled_lr(optimizer, scale):
        optimizer.step()
    assert scale == {"none": 1.0, "linear": 0.36, "sqrt": 0.6}[mode]
    torch.testing.assert_close(weight.detach(), -LR * scale * GRAD, rtol=1e-6, atol=0)
    assert optimizer.param_groups[0]["lr"] == LR  # the very value, not LR * s / s


def test_the_workers_adamw_steps_as_one_built_with_the_scaled_lr() -> None:
    scaled_weight, reference_weight = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    scaled = OffloadAdamW([scaled_weight], lr=3e-4, weight_decay=0.1, offload=False)
    reference = OffloadAdamW([reference_weight], lr=3e-4 * 0.3, weight_decay=0.1, offload=False)
    for step in range(3):
        scaled_weight.grad = torch.full((4,), 1.0 + step)
        reference_weight.grad = torch.full((4,), 1.0 + step)
        with scaled_lr(scaled, 0.3):
            scaled.step()
        reference.step()
    assert torch.equal(scaled_weight.detach(), reference_weight.detach())
    assert scaled.param_groups[0]["lr"] == 3e-4


def test_the_lr_comes_back_when_the_step_fails() -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=LR)
    with pytest.raises(RuntimeError, match="step failed"), scaled_lr(optimizer, 0.5):
        assert optimizer.param_groups[0]["lr"] == LR * 0.5
        raise RuntimeError("step failed")
    assert optimizer.param_groups[0]["lr"] == LR


@pytest.fixture(scope="module")
def dht():
    node = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def test_the_epoch_controller_scales_its_step_by_the_share_it_measured(dht: DHT) -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=LR)
    epochs = EpochController(
        dht,
        f"share{time.monotonic_ns()}",
        [weight],
        optimizer,
        target_batch_size=4,
        clip_norm=100.0,
        sync=SyncState(SyncConfig(), lambda event: None, joining=False),
        on_epoch=lambda epoch: None,
        on_error=pytest.fail,
        on_skipped_step=pytest.fail,
        on_corrupt_weights=pytest.fail,
        share_scaling="sqrt",
    )
    try:
        weight.grad = 2 * GRAD  # the sum over two samples
        epochs.local_samples, epochs.last_share = 2, 0.25  # maybe_step measures the share before it steps
        epochs._step()
        torch.testing.assert_close(weight.detach(), -LR * math.sqrt(0.25) * GRAD, rtol=1e-6, atol=0)
        assert optimizer.param_groups[0]["lr"] == LR
    finally:
        epochs.shutdown()


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="optim.share_scaling"):
        load_config("tiny", {"optim": {"share_scaling": "cube"}})
