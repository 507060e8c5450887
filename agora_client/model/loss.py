"""The tail's loss computed over the sequence in chunks: the [tokens x vocab] logits never exist at once.

Forward keeps only the per-token losses; backward recomputes each chunk's logits to form its
gradient (softmax - one_hot), so at most one chunk of logits (and its gradient) is alive. Under
autocast the products run in autocast's dtype and the saved hidden state is stored in it too; the
weight's gradient is summed over the chunks in fp32 whatever the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agora_client.model.layers import autocast_off, compute_dtype

LOSS_CHUNK_TOKENS = 1024  # logits alive at once: LOSS_CHUNK_TOKENS x vocab floats


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, dtype: torch.dtype):
        with autocast_off(hidden.device):
            low, low_weight = hidden.to(dtype), weight.to(dtype)
            losses = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
            for start in range(0, labels.numel(), chunk):
                logits = F.linear(low[start : start + chunk], low_weight).float()
                losses[start : start + chunk] = F.cross_entropy(logits, labels[start : start + chunk], reduction="none")
        ctx.save_for_backward(low, weight, labels)
        ctx.chunk, ctx.hidden_dtype = chunk, hidden.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        low, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty(low.shape, dtype=ctx.hidden_dtype, device=low.device)
        # summed over the chunks in fp32 even for bf16 weights (the offload layout), cast once at the end
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        with autocast_off(low.device):
            low_weight = weight.to(low.dtype)
            for start in range(0, labels.numel(), ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                probs = torch.softmax(F.linear(low[rows], low_weight).float(), dim=-1)
                probs[torch.arange(probs.shape[0], device=probs.device), labels[rows]] -= 1.0
                grad_logits = probs.mul_(grad_losses[rows, None]).to(low.dtype)
                grad_hidden[rows] = grad_logits @ low_weight
                if grad_weight is not None:
                    grad_weight.add_(grad_logits.T @ low[rows])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def per_token_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = LOSS_CHUNK_TOKENS
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, labels) per token, float32 [N], for hidden [N, d] and labels [N]."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk, compute_dtype(hidden))


def per_sample_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = LOSS_CHUNK_TOKENS
) -> torch.Tensor:
    """Mean cross-entropy per sequence, float32 [B], for hidden [B, T, d] and labels [B, T]."""
    batch, seq, width = hidden.shape
    losses = per_token_loss(hidden.reshape(batch * seq, width), weight, labels.reshape(-1), chunk)
    return losses.view(batch, seq).mean(dim=1)
