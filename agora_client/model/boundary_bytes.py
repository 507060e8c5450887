"""Bytes a stage boundary puts on the wire, dense against Subspace-compressed, with hivemind's serializer."""

from __future__ import annotations

import torch

from agora_client.config import ConfigError, ModelConfig
from agora_client.model.stages import StageModule, build_stage


def _wire_bytes(tensor: torch.Tensor) -> int:
    # imported here: the model package loads without hivemind (bench/gpu_check.py runs where it is not installed)
    from hivemind.compression import serialize_torch_tensor
    from hivemind.proto.runtime_pb2 import CompressionType

    # CompressionType.NONE writes the raw buffer, so the size depends on shape and dtype only:
    # a meta-device run supplies the shape and random values of that shape stand in for the data.
    if tensor.is_meta:
        tensor = torch.randn(tensor.shape).to(tensor.dtype)
    return serialize_torch_tensor(tensor.detach().cpu(), CompressionType.NONE).ByteSize()


def _stage_inputs(module: StageModule, boundary: torch.Tensor | None, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if boundary is None:
        return (tokens,)
    if module.stage == "tail":
        return boundary, tokens, tokens
    return boundary, tokens


def _measure(
    config: ModelConfig, stage: str, tokens: torch.Tensor, seed: int, device: torch.device, compress: bool
) -> dict[str, int]:
    """Run the pipeline up to `stage`, then the next stage's forward and backward; serialize both directions."""
    names = config.stage_names
    receiver_name = names[names.index(stage) + 1]
    boundary = None
    with torch.no_grad():
        for name in names[: names.index(stage) + 1]:
            sender = build_stage(config, name, seed=seed, device=device, compress_boundary=compress)
            boundary = sender(*_stage_inputs(sender, boundary, tokens))
            del sender
    receiver = build_stage(config, receiver_name, seed=seed, device=device, compress_boundary=compress)
    received = boundary.detach().requires_grad_(True)
    output = receiver(*_stage_inputs(receiver, received, tokens))
    (grad,) = torch.autograd.grad(output, received, grad_outputs=torch.ones_like(output))
    return {
        "width": int(boundary.shape[-1]),
        "activation_bytes": _wire_bytes(boundary),
        "token_id_bytes": _wire_bytes(tokens),
        "backward_bytes": _wire_bytes(grad),
    }


def serialized_boundary_bytes(
    config: ModelConfig, stage: str, batch: int, seq_len: int, *, seed: int = 0, device: str | torch.device = "cpu"
) -> dict:
    """Serialized bytes crossing the boundary after `stage`, forward (boundary + token ids) and backward (its grad).

    Runs the real stage code twice, with a dense boundary h [B, T, d] and with the compressed c [B, T, k],
    and serializes the tensors with hivemind's serialize_torch_tensor (CompressionType.NONE), as workers do.
    device="meta" runs the stages without allocating them (for the 8b shapes); the tensors serialized are
    then random values of the exact shapes and dtypes the stages produced.
    """
    config.stage(stage)
    if stage == "tail":
        raise ConfigError("the tail sends no boundary: pick head or a body stage")
    if not config.subspace.enabled:
        raise ConfigError("boundary compression needs model.subspace.enabled: true in the run config")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be positive; got batch={batch}, seq_len={seq_len}")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator).to(device)
    tokens_count = batch * seq_len
    result: dict = {"stage": stage, "batch": batch, "seq_len": seq_len, "tokens": tokens_count}
    for label, compress in (("dense", False), ("compressed", True)):
        sizes = _measure(config, stage, tokens, seed, device, compress)
        forward = sizes["activation_bytes"] + sizes["token_id_bytes"]
        result[label] = {
            **sizes,
            "forward_bytes": forward,
            "forward_bytes_per_token": forward / tokens_count,
            "backward_bytes_per_token": sizes["backward_bytes"] / tokens_count,
        }
    dense, compressed = result["dense"], result["compressed"]
    result["ratio_activation"] = dense["activation_bytes"] / compressed["activation_bytes"]
    result["ratio_forward"] = dense["forward_bytes"] / compressed["forward_bytes"]
    result["ratio_backward"] = dense["backward_bytes"] / compressed["backward_bytes"]
    result["ratio_total"] = (dense["forward_bytes"] + dense["backward_bytes"]) / (
        compressed["forward_bytes"] + compressed["backward_bytes"]
    )
    return result
