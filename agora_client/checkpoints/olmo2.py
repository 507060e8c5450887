"""Our stages as one dense Hugging Face OLMo2 model (``Olmo2ForCausalLM``): config and weights.

The architectures match block for block: no biases, q_norm / k_norm over the full projected width
before the heads are split, half-split rotary (``rotate_half``) with the same inverse frequencies,
RMSNorm on each sublayer's output before the residual add, SwiGLU, untied lm_head. What Subspace
Networks add is folded back into dense weights:

- embedding: E_f + emb' U^T  (the frozen table plus the trainable k-wide table lifted into span(U));
- a residual writer W = W' U^T as a map: dense weight U W' ([d, k] @ [k, in]);
- a frozen scalar-gain norm: a weight vector filled with that gain.
"""

from __future__ import annotations

from typing import Any

import torch

from agora_client.config import ModelConfig
from agora_client.model import StageModule, Subspace
from agora_client.model.layers import Block, RMSNorm
from agora_client.model.subspace import SubspaceLinear


class ExportError(Exception):
    """The model holds something OLMo2 cannot express; the message names it."""


def olmo2_config(config: ModelConfig) -> dict[str, Any]:
    """config.json for ``Olmo2ForCausalLM``; the byte tokenizer has no special tokens."""
    return {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def olmo2_state_dict(config: ModelConfig, stages: dict[str, StageModule]) -> dict[str, torch.Tensor]:
    """Dense OLMo2 weights from every stage of one run (all parameters accounted for, or ExportError)."""
    state: dict[str, torch.Tensor] = {}
    used: set[int] = set()

    def take(tensor: torch.Tensor) -> torch.Tensor:
        used.add(id(tensor))
        return tensor.detach().to(torch.float32).contiguous().clone()

    head, tail = stages["head"], stages["tail"]
    subspace = head.subspace
    embedding = take(head.embed.weight)
    if subspace is not None:  # E_f is hashed row by row, never stored: build the whole table once here
        embedding = subspace.embed(torch.arange(config.vocab_size, device=embedding.device)) + subspace.lift(embedding)
    state["model.embed_tokens.weight"] = embedding
    for stage in stages.values():
        for index, block in stage.layers.items():
            state.update(_block(f"model.layers.{index}", block, stage.subspace, config, take))
    state["model.norm.weight"] = _norm(tail.final_norm, config, take)
    state["lm_head.weight"] = take(tail.lm_head.weight)
    left = [f"{name}.{key}" for name, stage in stages.items() for key, tensor in stage.named_parameters() if id(tensor) not in used]
    if left:
        raise ExportError(f"no OLMo2 counterpart for {', '.join(left[:5])}: teach checkpoints/olmo2.py where they go")
    layers = sorted(int(index) for stage in stages.values() for index in stage.layers)
    if layers != list(range(config.n_layers)):
        raise ExportError(f"the stages hold layers {layers} but the model has {config.n_layers}: a stage is missing or doubled")
    return state


def _block(prefix: str, block: Block, subspace: Subspace | None, config: ModelConfig, take) -> dict[str, torch.Tensor]:
    attn, mlp = block.attn, block.mlp
    return {
        f"{prefix}.self_attn.q_proj.weight": take(attn.q_proj.weight),
        f"{prefix}.self_attn.k_proj.weight": take(attn.k_proj.weight),
        f"{prefix}.self_attn.v_proj.weight": take(attn.v_proj.weight),
        f"{prefix}.self_attn.o_proj.weight": _dense(attn.o_proj, subspace, take),
        f"{prefix}.self_attn.q_norm.weight": _norm(attn.q_norm, config, take),
        f"{prefix}.self_attn.k_norm.weight": _norm(attn.k_norm, config, take),
        f"{prefix}.post_attention_layernorm.weight": _norm(block.attn_norm, config, take),
        f"{prefix}.mlp.gate_proj.weight": take(mlp.gate_proj.weight),
        f"{prefix}.mlp.up_proj.weight": take(mlp.up_proj.weight),
        f"{prefix}.mlp.down_proj.weight": _dense(mlp.down_proj, subspace, take),
        f"{prefix}.post_feedforward_layernorm.weight": _norm(block.mlp_norm, config, take),
    }


def _dense(layer: torch.nn.Module, subspace: Subspace | None, take) -> torch.Tensor:
    if isinstance(layer, SubspaceLinear):
        if subspace is None:
            raise ExportError("a subspace-constrained layer in a stage without a subspace basis")
        return subspace.basis @ take(layer.weight)  # x -> (x W'^T) U^T = x (U W')^T
    return take(layer.weight)


def _norm(norm: RMSNorm, config: ModelConfig, take) -> torch.Tensor:
    if norm.weight is not None:
        return take(norm.weight)
    return torch.full((config.d_model,), float(norm.scalar_gain))  # frozen norms sit on the residual stream
