"""The tiny preset with body1 widened to a size that matters.

For the benches that need a large stage (not a bench itself).

The width is chosen by counting the built stage's parameters (on the meta device), not by a formula: the
Subspace constraint makes a body layer's size depend on more than its width.
"""

from __future__ import annotations

from agora_client.config import RunConfig, load_config
from agora_client.model import param_counts

STAGE = "body1"
HEAD_DIM = 64


def widened_config(body_params: float, layers: int) -> RunConfig:
    """tiny, with body1 of ``layers`` layers of the width (a multiple of 64, feed-forward 3x) that brings it
    nearest ``body_params`` parameters."""
    candidates = (_with_width(width, layers) for width in range(HEAD_DIM, 16385, HEAD_DIM))
    best = None
    for config in candidates:
        size = param_counts(config.model)[STAGE]
        if best is None or abs(size - body_params) < abs(best[0] - body_params):
            best = (size, config)
        if size > body_params:
            break
    return best[1]


def _with_width(d_model: int, layers: int) -> RunConfig:
    tiny = load_config("tiny")
    stages = tuple(
        spec.model_copy(update={"layers": layers if spec.name == STAGE else 1}) for spec in tiny.model.stages
    )
    model = tiny.model.model_copy(
        update={
            "d_model": d_model,
            "n_heads": d_model // HEAD_DIM,
            "ffn_hidden": 3 * d_model,
            "n_layers": sum(spec.layers for spec in stages),
            "stages": stages,
        }
    )
    return tiny.model_copy(update={"model": model})
