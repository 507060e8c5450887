"""Subspace Networks: compressed boundaries lose nothing, the residual stays in E_f + span(U), 8b sends ~100x less."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

from agora_client import describe
from agora_client.config import ConfigError, ModelConfig, load_config
from agora_client.model import StageModule, build_stage, serialized_boundary_bytes
from agora_client.model.subspace import SubspaceLinear, fixed_embedding

SEED = 11
BATCH, SEQ = 2, 24


def tiny(subspace: bool = True) -> ModelConfig:
    return load_config("tiny", {"model": {"subspace": {"enabled": subspace}}}).model


def pipeline(config: ModelConfig, compress: bool) -> list[StageModule]:
    return [build_stage(config, name, seed=SEED, compress_boundary=compress) for name in config.stage_names]


def batch(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def run_detached(stages: list[StageModule], tokens, labels) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward through detached boundaries (as across processes), then backward stage by stage with the
    gradient the next stage sent back. Returns the per-sample loss and the boundaries that were sent."""
    received_inputs, outputs, boundary = [], [], None
    for stage in stages:
        received = None if boundary is None else boundary.detach().requires_grad_(True)
        if received is None:
            boundary = stage(tokens)
        elif stage.stage == "tail":
            boundary = stage(received, tokens, labels)
        else:
            boundary = stage(received, tokens)
        received_inputs.append(received)
        outputs.append(boundary)
    loss = outputs[-1]
    grad = torch.full_like(loss, 1.0 / loss.shape[0])
    for received, output in zip(reversed(received_inputs), reversed(outputs), strict=True):
        output.backward(grad)
        grad = None if received is None else received.grad
    return loss.detach(), [output.detach() for output in outputs[:-1]]


def test_compressed_pipeline_equals_dense_pipeline() -> None:
    config = tiny()
    tokens, labels = batch(config)
    dense, compressed = pipeline(config, compress=False), pipeline(config, compress=True)
    dense_loss, dense_sent = run_detached(dense, tokens, labels)
    compressed_loss, compressed_sent = run_detached(compressed, tokens, labels)

    assert all(sent.shape[-1] == config.d_model for sent in dense_sent)
    assert all(sent.shape[-1] == config.subspace_rank for sent in compressed_sent)
    torch.testing.assert_close(compressed_loss, dense_loss, rtol=1e-5, atol=1e-6)
    for dense_stage, compressed_stage in zip(dense, compressed, strict=True):
        compressed_grads = dict(compressed_stage.named_parameters())
        for name, param in dense_stage.named_parameters():
            assert param.grad is not None and param.grad.abs().sum() > 0, name
            torch.testing.assert_close(
                compressed_grads[name].grad, param.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
            )


def residual_outside_span(stages: list[StageModule], tokens, labels) -> list[float]:
    """Relative size of (h - E_f[tokens]) outside span(U) at every boundary of a dense-boundary pipeline."""
    subspace = stages[0].subspace
    _, sent = run_detached(stages, tokens, labels)
    ratios = []
    for hidden in sent:
        offset = hidden - subspace.embed(tokens)
        outside = offset - subspace.lift(offset @ subspace.basis)
        ratios.append(float(outside.norm() / offset.norm()))
    return ratios


def test_every_boundary_lies_in_fixed_embedding_plus_span_of_u() -> None:
    config = tiny()
    tokens, labels = batch(config)
    ratios = residual_outside_span(pipeline(config, compress=False), tokens, labels)
    assert len(ratios) == len(config.stages) - 1
    assert max(ratios) < 1e-5, ratios


def test_the_span_check_would_catch_an_unconstrained_block() -> None:
    config = tiny()
    tokens, labels = batch(config)
    stages = pipeline(config, compress=False)
    with torch.no_grad():  # a per-channel gain on one output norm breaks linearity, as the issue warns
        stages[1].layers["1"].mlp_norm.scalar_gain = torch.linspace(0.5, 1.5, config.d_model)
    ratios = residual_outside_span(stages, tokens, labels)
    assert ratios[0] < 1e-5 and ratios[1] > 1e-2, ratios


def test_basis_is_orthonormal_and_the_same_on_every_stage_and_build() -> None:
    config = tiny()
    head, tail = build_stage(config, "head", seed=SEED), build_stage(config, "tail", seed=SEED)
    again = build_stage(config, "head", seed=SEED)
    basis = head.subspace.basis
    assert basis.shape == (config.d_model, config.subspace_rank) and basis.dtype == torch.float32
    torch.testing.assert_close(basis.T @ basis, torch.eye(config.subspace_rank), atol=1e-6, rtol=0)
    every_token = torch.arange(config.vocab_size)
    table = head.subspace.embed(every_token)
    for other in (tail, again):
        assert torch.equal(other.subspace.basis, basis)
        assert torch.equal(other.subspace.embed(every_token), table)
    assert torch.linalg.matrix_rank(table) == min(config.vocab_size, config.d_model)
    assert torch.equal(table, fixed_embedding(config.vocab_size, config.d_model, config.init_std, SEED))
    assert not torch.equal(build_stage(config, "head", seed=SEED + 1).subspace.basis, basis)


def test_fixed_embedding_rows_are_generated_not_stored() -> None:
    config = tiny()
    table = fixed_embedding(config.vocab_size, config.d_model, config.init_std, SEED)
    tokens = torch.tensor([[3, 200, 3], [255, 0, 17]])
    rows = build_stage(config, "body1", seed=SEED).subspace.embed(tokens)
    assert rows.shape == (2, 3, config.d_model) and torch.equal(rows, table[tokens])
    assert abs(float(table.std()) / config.init_std - 1) < 0.02 and abs(float(table.mean())) < 1e-3 * 2
    assert not torch.equal(table, fixed_embedding(config.vocab_size, config.d_model, config.init_std, SEED + 1))


def test_basis_is_a_frozen_buffer_outside_snapshots_and_e_f_takes_no_memory() -> None:
    for name in tiny().stage_names:
        stage = build_stage(tiny(), name, seed=SEED)
        buffers = dict(stage.named_buffers())
        assert set(buffers) == {"subspace.basis"}
        assert not any(key.startswith("subspace.") for key in stage.state_dict())
        assert not any(key.startswith("subspace.") for key, _ in stage.named_parameters())


def test_only_blocks_whose_output_crosses_a_boundary_are_constrained() -> None:
    config = tiny()
    k, d = config.subspace_rank, config.d_model
    head = build_stage(config, "head", seed=SEED)
    assert head.embed.weight.shape == (config.vocab_size, k)
    for name in ("head", "body1", "body2"):
        for block in build_stage(config, name, seed=SEED).layers.values():
            assert isinstance(block.attn.o_proj, SubspaceLinear) and block.attn.o_proj.weight.shape == (k, d)
            assert isinstance(block.mlp.down_proj, SubspaceLinear)
            assert block.mlp.down_proj.weight.shape == (k, config.ffn_hidden)
            assert block.attn_norm.weight is None and block.mlp_norm.weight is None  # frozen scalar gains
            assert block.attn.q_norm.weight is not None  # QK-norm untouched
    for block in build_stage(config, "tail", seed=SEED).layers.values():
        assert block.attn.o_proj.weight.shape == (d, d) and block.mlp.down_proj.weight.shape == (d, config.ffn_hidden)
        assert block.attn_norm.weight is not None and block.mlp_norm.weight is not None


def test_describe_8b_reports_k_51_and_about_100x(capsys: pytest.CaptureFixture[str], hub_offline) -> None:
    assert describe.run(argparse.Namespace(preset="8b", json=True)) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["k"] == 51 and info["d_model"] == 5120
    assert [stage["boundary_width"] for stage in info["stages"]] == [51] * 6 + [None]
    assert info["bytes_per_token"]["compressed_activation"] == 204

    assert describe.run(argparse.Namespace(preset="8b", json=False)) == 0
    table = capsys.readouterr().out
    assert "k = 51" in table and "body5" in table

    seq = 8  # the same serializer the workers use, on real [1, T, k] and [1, T, d] tensors
    dense = serialize_torch_tensor(torch.randn(1, seq, 5120), CompressionType.NONE).ByteSize()
    compressed = serialize_torch_tensor(torch.randn(1, seq, 51), CompressionType.NONE).ByteSize()
    assert 95 < dense / compressed < 105
    assert abs(dense / compressed - info["bytes_per_token"]["ratio_activation"]) < 5


def test_describe_names_a_bad_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert describe.run(argparse.Namespace(preset="no-such-preset", json=False)) == 2
    assert "no preset or file named 'no-such-preset'" in capsys.readouterr().err


def test_serialized_boundary_bytes_from_real_stage_runs() -> None:
    tiny_bytes = serialized_boundary_bytes(tiny(), "body1", batch=2, seq_len=16)
    assert tiny_bytes["dense"]["width"] == 256 and tiny_bytes["compressed"]["width"] == 32
    assert 7.5 < tiny_bytes["ratio_activation"] <= 8 and 7.5 < tiny_bytes["ratio_backward"] <= 8
    assert tiny_bytes["dense"]["token_id_bytes"] == tiny_bytes["compressed"]["token_id_bytes"]

    big = serialized_boundary_bytes(load_config("8b").model, "head", batch=1, seq_len=16, device="meta")
    assert big["compressed"]["width"] == 51 and big["dense"]["width"] == 5120
    assert 95 < big["ratio_activation"] < 105 and 90 < big["ratio_total"] < 105
    with pytest.raises(ConfigError, match="tail sends no boundary"):
        serialized_boundary_bytes(tiny(), "tail", batch=1, seq_len=4)
