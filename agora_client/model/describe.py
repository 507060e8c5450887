"""`agora describe --preset 8b`: a preset's stages, parameter counts and boundary traffic, allocating nothing."""

from __future__ import annotations

import argparse
import json
import sys

from agora_client.config import ConfigError, ModelConfig, SubspaceConfig, load_config
from agora_client.model.stages import boundary_width, param_counts

FLOAT_BYTES = 4  # boundaries travel as float32
TOKEN_ID_BYTES = 8  # token ids travel as int64 beside every boundary, dense or compressed


def describe_model(config: ModelConfig) -> dict:
    """Per-stage layers and trainable parameters, and bytes per token per boundary, dense vs compressed."""
    counts = param_counts(config)
    compress = config.subspace.enabled
    stages = []
    for spec in config.stages:
        first = config.first_layer(spec.name)
        stages.append(
            {
                "name": spec.name,
                "layers": [first, first + spec.layers - 1],
                "parameters": counts[spec.name],
                "boundary_width": None if spec.name == "tail" else boundary_width(config, compress),
            }
        )
    dense = config.d_model * FLOAT_BYTES
    compressed = boundary_width(config, compress) * FLOAT_BYTES
    return {
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "vocab_size": config.vocab_size,
        "seq_len": config.seq_len,
        "subspace": compress,
        "k": config.subspace_rank if compress else None,
        "stages": stages,
        "total_parameters": sum(counts.values()),
        # the same shapes with full-rank residual writers, for comparison with the model's nominal size
        "total_parameters_unconstrained": sum(
            param_counts(config.model_copy(update={"subspace": SubspaceConfig(enabled=False)})).values()
        ),
        "bytes_per_token": {
            "dense_activation": dense,
            "compressed_activation": compressed,
            "token_id": TOKEN_ID_BYTES,
            "ratio_activation": dense / compressed,
            "ratio_forward_with_token_ids": (dense + TOKEN_ID_BYTES) / (compressed + TOKEN_ID_BYTES),
        },
    }


def format_description(name: str, info: dict) -> str:
    subspace = f"on, k = {info['k']}" if info["subspace"] else "off"
    lines = [
        f"preset {name}: d_model {info['d_model']}, {info['n_layers']} layers, vocab {info['vocab_size']}, "
        f"seq_len {info['seq_len']}, subspace {subspace}",
        f"{'stage':<8}{'layers':<14}{'parameters':>16}   boundary sent",
    ]
    for stage in info["stages"]:
        first, last = stage["layers"]
        layers = f"{first}-{last} ({last - first + 1})"
        width = stage["boundary_width"]
        sent = "loss only" if width is None else f"{width} floats/token ({'k' if info['subspace'] else 'd'})"
        lines.append(f"{stage['name']:<8}{layers:<14}{stage['parameters']:>16,}   {sent}")
    lines.append(f"{'total':<8}{info['n_layers']:<14}{info['total_parameters']:>16,}")
    if info["subspace"]:
        lines.append(f"{'':<22}{info['total_parameters_unconstrained']:>16,}   without the subspace constraint")
    per_token = info["bytes_per_token"]
    lines.append(
        f"bytes per token per boundary: dense {per_token['dense_activation']:,} B, "
        f"compressed {per_token['compressed_activation']:,} B each way "
        f"(x{per_token['ratio_activation']:.1f}); plus {per_token['token_id']} B of token id forward "
        f"(x{per_token['ratio_forward_with_token_ids']:.1f} with it)"
    )
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="preset name (tiny, 8b) or path to a run config YAML")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.preset)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    info = describe_model(config.model)
    print(json.dumps(info) if args.json else format_description(config.name, info))
    return 0
