"""Analytic FLOPs of one pipeline stage for one microbatch, from its shapes alone.

What is counted: every matrix multiplication, at 2*m*n*k FLOPs, in the stage's forward:
  - per block: q/k/v projections, attention scores (Q K^T) and values (P V) over the full T x T
    square (causal masking is not discounted), the output projection, SwiGLU gate/up/down;
    with Subspace Networks a residual writer W = W' U^T is two products: x W'^T (width k), then the lift c U^T;
  - the head's embedding lift emb'(tokens) U^T (subspace), the boundary reconstruction c U^T on a
    receiving stage and the projection (h - E_f[tokens]) U on a sending stage (compressed boundaries);
  - the tail's lm_head (its loss is chunked: the backward recomputes each chunk's logits, so its
    backward costs 3x its forward: logits again, then the gradients of the hidden state and the weight).
Not counted: embedding lookups, norms, RoPE, softmax, SiLU, additions, the loss (not matmuls).

Backward: each matmul costs 2*m*n*k again for every operand that needs a gradient. Weights and
activations need one, so most products cost 2x their forward; the Subspace basis U is a frozen
buffer, so products with U cost 1x (only the activation's gradient is computed).

A worker re-runs its forward before every backward (activation recomputation), so a backward
request costs forward + backward; a forward request costs forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agora_client.config import ModelConfig

RequestKind = Literal["forward", "backward"]


@dataclass(frozen=True)
class Matmul:
    name: str
    forward: int  # FLOPs of the forward product
    grads: int  # the backward costs grads * forward: operands needing a gradient (1 or 2); 3 for the chunked lm_head

    @property
    def backward(self) -> int:
        return self.grads * self.forward


def _mm(name: str, m: int, n: int, k: int, grads: int = 2) -> Matmul:
    return Matmul(name, 2 * m * n * k, grads)


def _block(config: ModelConfig, index: int, batch: int, seq_len: int, constrained: bool) -> list[Matmul]:
    d, f, kv = config.d_model, config.ffn_hidden, config.kv_width
    tokens = batch * seq_len
    prefix = f"layers.{index}"
    heads = batch * config.n_heads
    products = [
        _mm(f"{prefix}.attn.q_proj", tokens, d, d),
        _mm(f"{prefix}.attn.k_proj", tokens, d, kv),
        _mm(f"{prefix}.attn.v_proj", tokens, d, kv),
        Matmul(f"{prefix}.attn.scores", heads * 2 * seq_len * seq_len * config.head_dim, 2),
        Matmul(f"{prefix}.attn.values", heads * 2 * seq_len * seq_len * config.head_dim, 2),
    ]
    products += _writer(f"{prefix}.attn.o_proj", tokens, d, config, constrained)
    products += [_mm(f"{prefix}.mlp.gate_proj", tokens, d, f), _mm(f"{prefix}.mlp.up_proj", tokens, d, f)]
    products += _writer(f"{prefix}.mlp.down_proj", tokens, f, config, constrained)
    return products


def _writer(name: str, tokens: int, in_features: int, config: ModelConfig, constrained: bool) -> list[Matmul]:
    if not constrained:
        return [_mm(name, tokens, in_features, config.d_model)]
    rank = config.subspace_rank
    return [_mm(name, tokens, in_features, rank), _mm(f"{name}.lift", tokens, rank, config.d_model, grads=1)]


def stage_matmuls(
    config: ModelConfig, stage: str, batch: int, seq_len: int, *, compress_boundary: bool | None = None
) -> list[Matmul]:
    """Every matmul of the stage's forward for a [batch, seq_len] microbatch, in execution order."""
    if batch < 0 or seq_len < 0:
        raise ValueError(f"batch and seq_len must be non-negative, got {batch} and {seq_len}")
    spec = config.stage(stage)
    compress = config.subspace.enabled if compress_boundary is None else compress_boundary
    d, rank, tokens = config.d_model, config.subspace_rank, batch * seq_len
    products: list[Matmul] = []
    if stage == "head" and config.subspace.enabled:
        products.append(_mm("embed.lift", tokens, rank, d, grads=1))
    if stage != "head" and compress:
        products.append(_mm("receive.lift", tokens, rank, d, grads=1))
    first = config.first_layer(stage)
    tail_first = config.first_layer("tail")
    for index in range(first, first + spec.layers):
        constrained = config.subspace.enabled and index < tail_first
        products += _block(config, index, batch, seq_len, constrained)
    if stage == "tail":
        products.append(_mm("lm_head", tokens, d, config.vocab_size, grads=3))
    elif compress:
        products.append(_mm("send.project", tokens, d, rank, grads=1))
    return products


def forward_flops(
    config: ModelConfig, stage: str, batch: int, seq_len: int, *, compress_boundary: bool | None = None
) -> int:
    return sum(p.forward for p in stage_matmuls(config, stage, batch, seq_len, compress_boundary=compress_boundary))


def backward_flops(
    config: ModelConfig, stage: str, batch: int, seq_len: int, *, compress_boundary: bool | None = None
) -> int:
    """The backward pass alone (gradients of inputs and parameters), without the recomputed forward."""
    return sum(p.backward for p in stage_matmuls(config, stage, batch, seq_len, compress_boundary=compress_boundary))


def request_flops(
    config: ModelConfig,
    stage: str,
    kind: RequestKind,
    batch: int,
    seq_len: int,
    *,
    compress_boundary: bool | None = None,
) -> int:
    """FLOPs a worker spends on one request: forward, or recomputed forward + backward."""
    forward = forward_flops(config, stage, batch, seq_len, compress_boundary=compress_boundary)
    if kind == "forward":
        return forward
    if kind == "backward":
        return forward + backward_flops(config, stage, batch, seq_len, compress_boundary=compress_boundary)
    raise ValueError(f"request kind must be 'forward' or 'backward', got {kind!r}")
