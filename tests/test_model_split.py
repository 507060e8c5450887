"""The stages run in sequence give the unsplit model's loss and parameter gradients (subspace on and off)."""

from __future__ import annotations

import pytest
import torch
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.config import ConfigError, ModelConfig, load_config
from agora_client.model import (
    StageModule,
    build_full_model,
    build_stage,
    param_counts,
    trainable_parameter_count,
)
from agora_client.snapshots import load_stage_snapshot, save_stage_snapshot

SEED = 7
BATCH, SEQ = 2, 24


def tiny(subspace: bool) -> ModelConfig:
    return load_config("tiny", {"model": {"subspace": {"enabled": subspace}}}).model


def stages_of(config: ModelConfig, seed: int = SEED, **kwargs) -> list[StageModule]:
    return [build_stage(config, name, seed=seed, **kwargs) for name in config.stage_names]


def batch(config: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def inputs_for(stage: StageModule, boundary, tokens, labels) -> tuple[torch.Tensor, ...]:
    if stage.stage == "head":
        return (tokens,)
    return (boundary, tokens, labels) if stage.stage == "tail" else (boundary, tokens)


def grads(modules) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for module in modules for name, p in module.named_parameters()}


def full_reference(config: ModelConfig, tokens, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    full = build_full_model(config, seed=SEED)
    loss = full(tokens, labels)
    loss.mean().backward()
    return loss.detach(), grads([full])


def assert_grads_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(actual[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace", "dense"])
def test_stages_start_from_the_unsplit_models_weights(subspace: bool) -> None:
    config = tiny(subspace)
    full = build_full_model(config, seed=SEED).state_dict()
    split = {name: tensor for stage in stages_of(config) for name, tensor in stage.state_dict().items()}
    assert split.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(split[name], tensor), name


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace", "dense"])
def test_split_pipeline_matches_unsplit_model(subspace: bool) -> None:
    config = tiny(subspace)
    tokens, labels = batch(config)
    expected_loss, expected_grads = full_reference(config, tokens, labels)

    stages = stages_of(config)
    boundary = None
    for stage in stages:
        boundary = stage(*inputs_for(stage, boundary, tokens, labels))
    assert boundary.shape == (BATCH,) and boundary.dtype == torch.float32
    boundary.mean().backward()

    torch.testing.assert_close(boundary.detach(), expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads(stages), expected_grads)


def run_with_recomputation(stages: list[StageModule], tokens, labels) -> torch.Tensor:
    """What the swarm does: forward without a graph, then each stage re-runs forward on its input before backward."""
    received = [None]
    with torch.no_grad():
        for stage in stages[:-1]:
            received.append(stage(*inputs_for(stage, received[-1], tokens, labels)).detach())
        loss = stages[-1](*inputs_for(stages[-1], received[-1], tokens, labels))
    grad_out = torch.full_like(loss, 1.0 / loss.shape[0])  # d(mean over the batch)/d(per-sample loss)
    for stage, boundary in zip(reversed(stages), reversed(received), strict=True):
        if boundary is not None:
            boundary = boundary.clone().requires_grad_(True)
        output = stage(*inputs_for(stage, boundary, tokens, labels))
        torch.autograd.backward(output, grad_out)
        grad_out = boundary.grad if boundary is not None else None
    return loss


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace", "dense"])
def test_activation_recomputation_matches_unsplit_model(subspace: bool) -> None:
    config = tiny(subspace)
    tokens, labels = batch(config, seed=1)
    expected_loss, expected_grads = full_reference(config, tokens, labels)
    stages = stages_of(config)
    loss = run_with_recomputation(stages, tokens, labels)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads(stages), expected_grads)


def test_init_depends_on_seed_and_stage_only() -> None:
    config = tiny(True)
    first, again = build_stage(config, "body1", seed=3), build_stage(config, "body1", seed=3)
    other_seed = build_stage(config, "body1", seed=4)
    for (name, a), b, c in zip(
        first.state_dict().items(), again.state_dict().values(), other_seed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
        if "norm" not in name:  # norm gains all start at 1
            assert not torch.equal(a, c), name


def test_a_stage_built_for_a_snapshot_computes_as_the_seeded_one_once_loaded(tmp_path) -> None:
    config = tiny(True)
    seeded = build_stage(config, "head", seed=SEED)
    directory = save_stage_snapshot(
        tmp_path, "head", seeded, torch.optim.SGD(seeded.parameters(), lr=0.1), epoch=1, keep=1
    )
    for_load = build_stage(config, "head", seed=SEED, seeded_weights=False)
    assert torch.equal(for_load.subspace.basis, seeded.subspace.basis)  # derived from the seed, never saved
    load_stage_snapshot(directory, for_load, stage="head")
    tokens, _ = batch(config)
    assert torch.equal(for_load(tokens), seeded(tokens))


def test_olmo2_shape_of_a_dense_block() -> None:
    stage = build_stage(tiny(False), "body1", seed=0)
    names = [name for name, _ in stage.named_parameters()]
    assert not [name for name in names if name.endswith("bias")]
    assert {"layers.1.attn.q_norm.weight", "layers.1.attn.k_norm.weight"} <= set(names)
    # output norms of each sublayer, trainable per channel when the model is dense
    assert {"layers.1.attn_norm.weight", "layers.1.mlp_norm.weight"} <= set(names)
    tail = build_stage(tiny(False), "tail", seed=0)
    assert tail.lm_head.weight.data_ptr() != build_stage(tiny(False), "head", seed=0).embed.weight.data_ptr()
    assert tail.lm_head.weight.shape == (2048, 256)  # (vocab, d_model)


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace", "dense"])
def test_param_counts_match_built_stages_without_allocating(subspace: bool) -> None:
    config = tiny(subspace)
    counts = param_counts(config)
    assert counts == {stage.stage: trainable_parameter_count(stage) for stage in stages_of(config)}
    assert all(p.is_meta for p in build_stage(config, "tail", seed=0, device="meta").parameters())


@pytest.mark.parametrize("subspace", [True, False], ids=["subspace", "dense"])
def test_example_inputs_fit_forward_with_batch_first(subspace: bool) -> None:
    config = tiny(subspace)
    width = config.subspace_rank if subspace else config.d_model
    for stage in stages_of(config):
        inputs = stage.example_inputs(3)
        assert all(tensor.shape[:2] == (3, config.seq_len) for tensor in inputs)
        output = stage(*inputs)
        expected = (3,) if stage.stage == "tail" else (3, config.seq_len, width)
        assert output.shape == expected


def test_a_hivemind_module_backend_hosts_a_stage() -> None:
    """The worker's seam.

    ModuleBackend builds schemas from example_inputs, backward recomputes and returns input grads."""
    config = tiny(True)
    stage = build_stage(config, "body1", seed=SEED)
    schema = tuple(BatchTensorDescriptor.from_tensor(tensor) for tensor in stage.example_inputs(1))
    backend = ModuleBackend("body1.0.0", stage, args_schema=schema, max_batch_size=16)
    assert backend.outputs_schema.shape == (None, config.seq_len, config.subspace_rank)

    boundary = torch.randn(2, config.seq_len, config.subspace_rank)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len))
    (output,) = backend.forward(boundary, tokens)
    torch.testing.assert_close(output, stage(boundary, tokens).detach())

    grad_output = torch.randn_like(output)
    grad_boundary, grad_tokens = backend.backward(boundary, tokens, grad_output)
    reference = boundary.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(stage(reference, tokens), reference, grad_output)
    torch.testing.assert_close(grad_boundary, expected)
    assert grad_tokens.dtype == torch.int64 and not grad_tokens.any()


def test_bad_inputs_fail_with_one_clear_error() -> None:
    config = tiny(True)
    head, body = build_stage(config, "head", seed=0), build_stage(config, "body1", seed=0)
    tokens = torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError, match=r"must lie in \[0, 2048\)"):
        head(torch.full((2, 8), 3000))
    with pytest.raises(ValueError, match="int64"):
        head(tokens.float())
    with pytest.raises(ValueError, match="subspace compression set the same"):
        body(torch.zeros(2, 8, config.d_model), tokens)
    with pytest.raises(ValueError, match="does not match"):
        body(torch.zeros(2, 8, config.subspace_rank), tokens[:, :4])
    with pytest.raises(ConfigError, match="unknown stage 'body9'"):
        build_stage(config, "body9", seed=0)
    with pytest.raises(ConfigError, match="subspace.enabled"):
        build_stage(tiny(False), "head", seed=0, compress_boundary=True)
