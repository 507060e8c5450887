"""BF16 autocast on the CPU, the offloaded chunked AdamW, the chunked tail loss and the fp32 RMSNorm."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from agora_client.config import load_config
from agora_client.model import build_full_model, layers
from agora_client.model.layers import RMSNorm, autocast_context
from agora_client.model.loss import per_token_loss
from agora_client.worker.optimizer import OffloadAdamW, build_optimizer


def _train(mixed: bool, steps: int) -> list[float]:
    config = load_config(
        "tiny", {"model": {"seq_len": 32, "vocab_size": 256}, "tokenizer": {"source": "bytes", "sha256": None}}
    ).model
    model = build_full_model(config, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):  # a fresh batch each step of a learnable rule: the next token is this one + 1
        starts = torch.randint(0, config.vocab_size, (8, 1), generator=generator)
        data = (starts + torch.arange(config.seq_len + 1)) % config.vocab_size
        tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):  # bf16 even where the CPU emulates it
            loss = model(tokens, labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())  # fp32 master weights
    return losses


def test_bf16_autocast_training_tracks_fp32_on_cpu() -> None:
    steps = 20
    fp32, bf16 = _train(False, steps), _train(True, steps)
    assert fp32[-1] < fp32[0] - 1.5 and bf16[-1] < bf16[0] - 1.5  # both really learn the rule
    for step, (full, mixed) in enumerate(zip(fp32, bf16, strict=True)):
        assert abs(mixed - full) < 0.03 * full, (step, full, mixed)
    assert fp32 != bf16  # bf16 really ran


@pytest.mark.parametrize("native", [True, False])
def test_autocast_context_follows_the_run_config_where_bf16_is_native(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(layers, "native_bf16", lambda device: native)
    with autocast_context(torch.device("cpu"), True)():
        assert torch.is_autocast_enabled("cpu") == native
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == (torch.bfloat16 if native else torch.float32)
    with autocast_context(torch.device("cpu"), False)():
        assert not torch.is_autocast_enabled("cpu")


def _parameters(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (11,), (3, 4, 2)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "in-place"])
def test_chunked_offloaded_adamw_equals_adamw(offload: bool) -> None:
    expected, actual = _parameters(1), _parameters(1)
    reference = torch.optim.AdamW(expected, **HYPER, foreach=False)
    chunked = OffloadAdamW(actual, **HYPER, offload=offload, chunk_numel=4)  # every tensor spans several chunks
    _run(reference, expected, 5, seed=2)
    _run(chunked, actual, 5, seed=2)
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for param in actual:
        state = chunked.state[param]
        assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].shape == param.shape
        assert state["step"] == 5


def test_offloaded_adamw_state_dict_round_trips_and_reads_adamw_state() -> None:
    first = _parameters(1)
    optimizer = OffloadAdamW(first, **HYPER, chunk_numel=3)
    _run(optimizer, first, 3, seed=4)
    saved = optimizer.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = OffloadAdamW(resumed_params, lr=1.0, offload=False)  # hyperparameters come from the state dict
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == HYPER["lr"]
    _run(optimizer, first, 2, seed=5)
    _run(resumed, resumed_params, 2, seed=5)
    for want, got in zip(first, resumed_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)

    # torch's AdamW state has the same keys: a snapshot taken with it loads
    adamw_params = _parameters(1)
    adamw = torch.optim.AdamW(adamw_params, **HYPER, foreach=False)
    _run(adamw, adamw_params, 2, seed=6)
    loaded = OffloadAdamW([torch.nn.Parameter(p.detach().clone()) for p in adamw_params], **HYPER)
    loaded.load_state_dict(adamw.state_dict())
    for param, original in zip(loaded.param_groups[0]["params"], adamw_params, strict=True):
        torch.testing.assert_close(loaded.state[param]["exp_avg"], adamw.state[original]["exp_avg"])


def test_offloaded_adamw_rejects_state_of_another_shape() -> None:
    params = _parameters(1)
    optimizer = OffloadAdamW(params, **HYPER)
    _run(optimizer, params, 1, seed=0)
    state = optimizer.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(2)
    with pytest.raises(ValueError, match="does not fit a parameter of shape"):
        OffloadAdamW(_parameters(1), **HYPER).load_state_dict(state)


def test_build_optimizer_follows_the_run_config() -> None:
    params = _parameters(0)
    assert build_optimizer(params, load_config("tiny")).offload
    optimizer = build_optimizer(params, load_config("tiny", {"offload_optimizer": False}))
    assert not optimizer.offload and optimizer.param_groups[0]["lr"] == load_config("tiny").optim.lr


_OPTIMIZER_LIFETIME = """
import sys, torch
from agora_client.worker.optimizer import OffloadAdamW
params = [torch.nn.Parameter(torch.randn(3, 2))]
optimizer = OffloadAdamW(params, offload=False)
params[0].grad = torch.ones(3, 2)
optimizer.step()
optimizer.load_state_dict(optimizer.state_dict())
optimizer.zero_grad(set_to_none=True)
print("torch._dynamo" in sys.modules)
"""


def test_the_optimizer_never_imports_torch_dynamo() -> None:
    # torch's Optimizer methods import it on first call: seconds of CPU at every worker start
    result = subprocess.run([sys.executable, "-c", _OPTIMIZER_LIFETIME], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_loss_equals_the_plain_loss_and_its_gradient(chunk: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(16, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 12, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (16,), generator=generator)
    upstream = torch.rand(16, generator=generator, dtype=torch.float64)

    plain = F.cross_entropy(F.linear(hidden, weight), labels, reduction="none")
    plain_grads = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    chunked = per_token_loss(hidden, weight, labels, chunk)
    chunked_grads = torch.autograd.grad((chunked.double() * upstream).sum(), (hidden, weight))

    torch.testing.assert_close(chunked.double(), plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_chunked_loss_under_bf16_autocast_tracks_fp32() -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (32,), generator=generator)
    plain = F.cross_entropy(F.linear(hidden, weight), labels, reduction="none")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = per_token_loss(hidden, weight, labels, 8)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=0.03, atol=0.05)
    chunked.sum().backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


@pytest.mark.parametrize("trainable", [True, False], ids=["per-channel gain", "frozen scalar gain"])
def test_rmsnorm_gradient_matches_autograd_of_the_formula(trainable: bool) -> None:
    norm = RMSNorm(6, 1e-6, trainable=trainable).double()
    if trainable:
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 6))
    else:
        norm.scalar_gain = 1.7
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    inputs = (x, norm.weight) if trainable else (x,)
    assert torch.autograd.gradcheck(lambda *args: norm(args[0]), inputs)
    gain = norm.weight if trainable else norm.scalar_gain
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x.detach().to(torch.bfloat16)).dtype == torch.bfloat16  # returned in its input's dtype


def test_a_stage_snapshot_carries_the_offloaded_optimizer_state(tmp_path) -> None:
    from agora_client.model import build_stage
    from agora_client.snapshots import load_stage_snapshot, save_stage_snapshot

    config = load_config("tiny")
    module = build_stage(config.model, "body1", seed=0)
    optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], config)
    _run(optimizer, list(module.parameters()), 2, seed=1)
    path = save_stage_snapshot(tmp_path, "body1", module, optimizer, 7, 1)

    restored = build_stage(config.model, "body1", seed=5)
    restored_optimizer = build_optimizer([p for p in restored.parameters() if p.requires_grad], config)
    assert load_stage_snapshot(path, restored, restored_optimizer, stage="body1").epoch == 7
    for (name, param), copy in zip(module.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(param, copy), name
        assert torch.equal(optimizer.state[param]["exp_avg_sq"], restored_optimizer.state[copy]["exp_avg_sq"])
        assert restored_optimizer.state[copy]["step"] == 2
