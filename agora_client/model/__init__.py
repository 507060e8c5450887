"""The OLMo2-style decoder, its pipeline stages and Subspace Networks compression."""

from agora_client.model.boundary_bytes import serialized_boundary_bytes
from agora_client.model.stages import (
    BodyStage,
    FullModel,
    HeadStage,
    StageModule,
    TailStage,
    boundary_width,
    build_full_model,
    build_stage,
    param_counts,
    trainable_parameter_count,
)
from agora_client.model.subspace import Subspace

__all__ = [
    "BodyStage",
    "FullModel",
    "HeadStage",
    "StageModule",
    "Subspace",
    "TailStage",
    "boundary_width",
    "build_full_model",
    "build_stage",
    "param_counts",
    "serialized_boundary_bytes",
    "trainable_parameter_count",
]
