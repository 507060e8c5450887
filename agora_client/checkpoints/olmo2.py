"""Our stages as one dense Hugging Face OLMo2 model (``Olmo2ForCausalLM``): config and weights.

The architectures match block for block: no biases, q_norm / k_norm over the full projected width
before the heads are split, half-split rotary (``rotate_half``) with the same inverse frequencies,
RMSNorm on each sublayer's output before the residual add, SwiGLU, untied lm_head. What Subspace
Networks add is folded back into dense weights, one stage at a time (a stage holds U and E_f's seed itself):

- embedding: E_f + emb' U^T  (the frozen table plus the trainable k-wide table lifted into span(U));
- a residual writer W = W' U^T as a map: dense weight U W' ([d, k] @ [k, in]);
- a frozen scalar-gain norm: a weight vector filled with that gain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from agora_client.config import ModelConfig
from agora_client.model import StageModule, Subspace
from agora_client.model.layers import Block, RMSNorm
from agora_client.model.subspace import SubspaceLinear


class ExportError(Exception):
    """The model holds something OLMo2 cannot express; the message names it."""


def olmo2_config(
    config: ModelConfig, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None
) -> dict[str, Any]:
    """config.json for ``Olmo2ForCausalLM`` with weights in ``dtype`` and the tokenizer's end-of-document id, if any."""
    dtype_name = str(dtype).removeprefix("torch.")
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
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def olmo2_parameter_count(config: ModelConfig) -> int:
    """The exported model's elements: everything ``olmo2_stage_tensors`` yields over all the stages."""
    d, kv, ffn, vocab = config.d_model, config.kv_width, config.ffn_hidden, config.vocab_size
    attention = 2 * d * d + 2 * d * kv + d + kv  # q, o; k, v; q_norm, k_norm
    block = attention + 3 * d * ffn + 2 * d  # gate, up, down; the two post-sublayer norms
    return 2 * vocab * d + config.n_layers * block + d  # embedding and lm_head, the blocks, the final norm


EMBEDDING_ROWS_PER_CHUNK = 1024  # E_f rows built at once when folding the embedding: bounds the scratch

Take = Callable[[torch.Tensor], torch.Tensor]
Tensors = Iterator[tuple[str, torch.Tensor]]


def olmo2_stage_tensors(config: ModelConfig, stage: StageModule, dtype: torch.dtype) -> Tensors:
    """The dense OLMo2 tensors of one stage in ``dtype``, one at a time (folded in float32, then cast); ExportError
    once the stage is done if one of its parameters had no counterpart. A tensor may share memory with the stage."""
    used: set[int] = set()

    def take(tensor: torch.Tensor) -> torch.Tensor:
        used.add(id(tensor))
        return tensor.detach().to(torch.float32)

    if stage.stage == "head":
        yield "model.embed_tokens.weight", _embedding(config, stage, take, dtype)
    for index, block in stage.layers.items():
        for name, tensor in _block(f"model.layers.{index}", block, stage.subspace, config, take):
            yield name, tensor.to(dtype)
    if stage.stage == "tail":
        yield "model.norm.weight", _norm(stage.final_norm, config, take).to(dtype)
        yield "lm_head.weight", take(stage.lm_head.weight).to(dtype)
    left = [f"{stage.stage}.{key}" for key, tensor in stage.named_parameters() if id(tensor) not in used]
    if left:
        raise ExportError(f"no OLMo2 counterpart for {', '.join(left[:5])}: teach checkpoints/olmo2.py where they go")


def check_layers(config: ModelConfig, layers: list[int]) -> None:
    """The layer indices the exported stages held cover the model once each, or ExportError."""
    if sorted(layers) != list(range(config.n_layers)):
        raise ExportError(
            f"the stages hold layers {sorted(layers)} but the model has {config.n_layers}: a stage is "
            "missing or doubled"
        )


def _embedding(config: ModelConfig, head: StageModule, take: Take, dtype: torch.dtype) -> torch.Tensor:
    weight = take(head.embed.weight)
    subspace = head.subspace
    if subspace is None:
        return weight.to(dtype)
    # E_f + emb' U^T, built chunk by chunk into the one table in its final dtype (E_f is hashed row by row, never
    # stored)
    table = torch.empty(config.vocab_size, config.d_model, dtype=dtype)
    for start in range(0, config.vocab_size, EMBEDDING_ROWS_PER_CHUNK):
        end = min(start + EMBEDDING_ROWS_PER_CHUNK, config.vocab_size)
        table[start:end] = subspace.embed(torch.arange(start, end)) + subspace.lift(weight[start:end])
    return table


def _block(prefix: str, block: Block, subspace: Subspace | None, config: ModelConfig, take: Take) -> Tensors:
    attn, mlp = block.attn, block.mlp
    yield f"{prefix}.self_attn.q_proj.weight", take(attn.q_proj.weight)
    yield f"{prefix}.self_attn.k_proj.weight", take(attn.k_proj.weight)
    yield f"{prefix}.self_attn.v_proj.weight", take(attn.v_proj.weight)
    yield f"{prefix}.self_attn.o_proj.weight", _dense(attn.o_proj, subspace, take)
    yield f"{prefix}.self_attn.q_norm.weight", _norm(attn.q_norm, config, take)
    yield f"{prefix}.self_attn.k_norm.weight", _norm(attn.k_norm, config, take)
    yield f"{prefix}.post_attention_layernorm.weight", _norm(block.attn_norm, config, take)
    yield f"{prefix}.mlp.gate_proj.weight", take(mlp.gate_proj.weight)
    yield f"{prefix}.mlp.up_proj.weight", take(mlp.up_proj.weight)
    yield f"{prefix}.mlp.down_proj.weight", _dense(mlp.down_proj, subspace, take)
    yield f"{prefix}.post_feedforward_layernorm.weight", _norm(block.mlp_norm, config, take)


def _dense(layer: torch.nn.Module, subspace: Subspace | None, take: Take) -> torch.Tensor:
    if isinstance(layer, SubspaceLinear):
        if subspace is None:
            raise ExportError("a subspace-constrained layer in a stage without a subspace basis")
        return subspace.basis @ take(layer.weight)  # x -> (x W'^T) U^T = x (U W')^T
    return take(layer.weight)


def _norm(norm: RMSNorm, config: ModelConfig, take: Take) -> torch.Tensor:
    if norm.weight is not None:
        return take(norm.weight)
    return torch.full((config.d_model,), float(norm.scalar_gain))  # frozen norms sit on the residual stream
