"""The analytic FLOP formula against torch's FlopCounterMode measured on the real tiny stage modules.

FlopCounterMode counts mm / addmm / bmm / baddbmm / sdpa kernels. On the CPU, PyTorch's default
SDPA kernel (_scaled_dot_product_flash_attention_for_cpu) has no FLOP formula, so we measure with
the MATH SDPA backend, which runs attention as bmm: then the formula and the measurement count
exactly the same products and must agree to the FLOP, forward and backward. With the default
kernel the measurement misses exactly the attention scores and values products.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from agora_client.config import load_config
from agora_client.model import build_stage
from agora_client.monitor.flops import backward_flops, forward_flops, request_flops, stage_matmuls
from agora_client.worker.metrics import WorkerMetrics

BATCH, SEQ = 2, 16  # a small microbatch: the formula is exact for any shape


def tiny(subspace: bool):
    return load_config("tiny", {"model": {"subspace": {"enabled": subspace}}}).model


def stage_inputs(module, config, stage: str) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=generator)
    if stage == "head":
        return (tokens,)
    boundary = torch.randn(BATCH, SEQ, module.boundary_width, generator=generator, requires_grad=True)
    return (boundary, tokens, tokens) if stage == "tail" else (boundary, tokens)


def measure(config, stage: str, backend: SDPBackend) -> tuple[int, int]:
    module = build_stage(config, stage, seed=0)
    inputs = stage_inputs(module, config, stage)
    with sdpa_kernel(backend):
        with FlopCounterMode(display=False) as forward_counter:
            output = module(*inputs)
        with FlopCounterMode(display=False) as backward_counter:
            output.sum().backward()
    return forward_counter.get_total_flops(), backward_counter.get_total_flops()


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace", "dense"])
@pytest.mark.parametrize("stage", ["head", "body1", "tail"])
def test_formula_equals_flop_counter_forward_and_backward(stage: str, subspace: bool):
    config = tiny(subspace)
    measured_forward, measured_backward = measure(config, stage, SDPBackend.MATH)
    assert forward_flops(config, stage, BATCH, SEQ) == measured_forward
    assert backward_flops(config, stage, BATCH, SEQ) == measured_backward
    # What a worker counts per backward request: the recomputed forward plus the backward.
    assert request_flops(config, stage, "backward", BATCH, SEQ) == measured_forward + measured_backward
    assert request_flops(config, stage, "forward", BATCH, SEQ) == measured_forward


def test_default_cpu_attention_kernel_is_the_only_gap():
    config = tiny(True)
    measured_forward, _ = measure(config, "body1", SDPBackend.FLASH_ATTENTION)
    attention = sum(
        p.forward for p in stage_matmuls(config, "body1", BATCH, SEQ) if p.name.endswith((".scores", ".values"))
    )
    assert attention > 0
    assert measured_forward == forward_flops(config, "body1", BATCH, SEQ) - attention


def test_backward_is_twice_forward_except_products_with_the_frozen_basis():
    config = tiny(True)
    products = stage_matmuls(config, "body1", BATCH, SEQ)
    frozen = [p for p in products if p.name.endswith((".lift", "send.project"))]
    assert frozen and all(p.grads == 1 for p in frozen)
    assert all(p.grads == 2 for p in products if p not in frozen)
    dense = tiny(False)
    assert backward_flops(dense, "body1", BATCH, SEQ) == 2 * forward_flops(dense, "body1", BATCH, SEQ)


def test_flops_scale_with_the_microbatch_tokens():
    config = tiny(False)
    one = forward_flops(config, "tail", 1, SEQ)
    assert forward_flops(config, "tail", 4, SEQ) == 4 * one
    with pytest.raises(ValueError, match="non-negative"):
        forward_flops(config, "tail", -1, SEQ)


def test_worker_metrics_count_the_formula_per_request():
    config = tiny(True)
    metrics = WorkerMetrics(config, "body1", peer_id="p", identity="alice", ticket="t")
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    metrics.set_phase("sync2")
    forward, backward = forward_flops(config, "body1", BATCH, SEQ), backward_flops(config, "body1", BATCH, SEQ)
    assert metrics.on_forward(tokens) == forward
    assert metrics.on_backward(tokens) == forward + backward  # recomputed forward + backward
    record = metrics.snapshot()
    assert record.flops_total == record.compute_flops == 2 * forward + backward
    assert (record.batches, record.forwards, record.tokens) == (1, 1, BATCH * SEQ)
