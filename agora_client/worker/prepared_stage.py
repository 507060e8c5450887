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
    config: RunConfig, stage: str, device: str | torch.device, *, seed: int, seeded_weights: bool
) -> PreparedStage:
    """Build the stage on its device and run it once on an example, as hivemind's backend would at start.

    That first call also pays the one-time costs of the first forward (torch's lazy imports, kernel
    set-up), so whoever calls this ahead of time takes them off the worker's start.
    """
    module = build_stage(config.model, stage, seed=seed, device=torch.device(device), seeded_weights=seeded_weights)
    example = module.example_inputs(1)
    outputs = module(*example)  # with autograd on, like hivemind's own schema run: the schema records requires_grad
    return PreparedStage(
        stage=stage,
        module=module,
        args_schema=tuple(BatchTensorDescriptor.from_tensor(tensor) for tensor in example),
        outputs_schema=nested_map(BatchTensorDescriptor.from_tensor, outputs),
        seeded=seeded_weights,
    )
