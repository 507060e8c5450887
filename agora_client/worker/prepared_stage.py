"""A worker's stage built before the worker starts: a contributor builds it while its snapshot downloads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hivemind.utils.nested import nested_map
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.config import RunConfig
from agora_client.model import build_stage


@dataclass(frozen=True)
class PreparedStage:
    stage: str
    module: torch.nn.Module
    args_schema: tuple[BatchTensorDescriptor, ...]
    outputs_schema: tuple[BatchTensorDescriptor, ...] | BatchTensorDescriptor
    seeded: bool  # False: the weights are uninitialized memory until a snapshot is loaded into them


def prepare_stage(
    config: RunConfig,
    stage: str,
    device: str | torch.device,
    *,
    seed: int,
    seeded_weights: bool,
    layout: str = "fp32",
) -> PreparedStage:
    """Build the stage where its layout keeps the master weights, with the schemas hivemind's backend would infer
    from a run on an example.

    The schemas come from a run on the meta device, which computes nothing. In the fp32 layout the stage also warms
    up on the device that serves (StageModule.warm_up), so whoever calls this ahead of time takes the first
    forward's one-time costs off the worker's start. In the offload layout the masters live on the host and
    requests run on a device copy: a forward on the host would take minutes at 8b, so there is none.
    """
    module = build_stage(
        config.model, stage, seed=seed, device=master_device(layout, device), seeded_weights=seeded_weights
    )
    example = module.example_inputs(1)
    if layout == "fp32":
        module.warm_up(config.use_mixed_precision)
    outputs = _schema_outputs(config, stage, example)
    return PreparedStage(
        stage=stage,
        module=module,
        args_schema=tuple(BatchTensorDescriptor.from_tensor(tensor) for tensor in example),
        outputs_schema=nested_map(BatchTensorDescriptor.from_tensor, outputs),
        seeded=seeded_weights,
    )


def master_device(layout: str, device: torch.device | str) -> torch.device:
    """Where a stage's master weights live: on its device, or on the host in the offload layout."""
    return torch.device("cpu") if layout == "offload" else torch.device(device)


def _schema_outputs(config: RunConfig, stage: str, example: tuple[torch.Tensor, ...]):
    """Empty tensors shaped like the stage's outputs for ``example``, on the example's device, from a meta run with
    autograd on, like hivemind's own schema run: the schema records requires_grad."""
    meta = build_stage(config.model, stage, seed=0, device=torch.device("meta"), seeded_weights=False)
    outputs = meta(*(tensor.detach().to("meta").requires_grad_(tensor.requires_grad) for tensor in example))
    device = example[0].device
    return nested_map(
        lambda out: torch.empty(out.shape, dtype=out.dtype, device=device).requires_grad_(out.requires_grad), outputs
    )
