"""OLMo2-style transformer blocks: RoPE, QK-norm, SwiGLU, no biases, norm on each sublayer's output."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.amp.autocast_mode import is_autocast_available

from agora_client.config import ModelConfig
from agora_client.model.subspace import Subspace, SubspaceLinear

Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, head_dim / 2]


class RMSNorm(nn.Module):
    """RMSNorm with a trainable per-channel gain, or a frozen scalar gain that keeps the map linear per token.

    With a scalar gain, g * x / rms(x) scales each token's vector by one number, so a vector in
    span(U) stays in span(U); a per-channel gain would rotate it out.
    """

    def __init__(self, dim: int, eps: float, *, trainable: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim)) if trainable else None
        self.scalar_gain = 1.0  # used only when frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.scalar_gain, self.eps)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNormFunction(torch.autograd.Function):
    """y = gain * x / rms(x), computed in fp32, returned in x's dtype; saves only x and 1/rms(x).

    Autograd of the plain expression would keep fp32 copies of x and of the normalized x, which
    under bf16 autocast is four times the bytes of x.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor | None, gain: float | torch.Tensor, eps: float
    ) -> torch.Tensor:
        with autocast_off(x.device):
            wide = _at_least_fp32(x)
            rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
            out = wide * rstd * (weight if weight is not None else gain)
        ctx.save_for_backward(x, rstd, weight)
        ctx.gain = gain
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        normed = _at_least_fp32(x) * rstd
        grad = _at_least_fp32(grad_out)
        scaled = grad * (weight if weight is not None else ctx.gain)
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).reshape(-1, normed.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_weight, None, None


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on tensor's device run in right now: autocast's when it is on, else tensor's."""
    if is_autocast_available(tensor.device.type) and torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` runs bf16 matmuls natively; emulated, they are slower than fp32, not faster.

    CUDA: compute capability 8.0 or newer. CPU: oneDNN's bf16 kernels (AVX-512 or AMX); an AVX2-only CPU
    falls back to a reference gemm, measured 95x slower than fp32 on a 2-core AMD EPYC.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def runs_bf16(device: torch.device, mixed_precision: bool) -> bool:
    """Whether a worker of the fp32 layout on ``device`` computes in bf16: the run asks for mixed precision and the
    device runs bf16 natively. Elsewhere it runs fp32 (GPUs without native bf16 are refused at join, see
    agora_client/joining/gpu_fit.py), and its memory plan is fp32's (model/memory.py, ``mixed_precision``)."""
    return mixed_precision and native_bf16(device)


def autocast_context(device: torch.device, mixed_precision: bool) -> Callable[[], AbstractContextManager]:
    """bf16 autocast where ``runs_bf16``; parameters and grads stay fp32 either way."""
    if not runs_bf16(device, mixed_precision):
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def autocast_off(device: torch.device) -> AbstractContextManager:
    """Autocast disabled inside (explicit dtypes), on any device, the meta device included."""
    return torch.autocast(device.type, enabled=False) if is_autocast_available(device.type) else nullcontext()


def lower_precision(x: torch.Tensor) -> torch.Tensor:
    """x in the matmuls' dtype: one cast shared by every projection that reads x (autocast would cast per use)."""
    return x.to(compute_dtype(x))


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype = torch.float32
) -> Rotary:
    """cos and sin per (position, frequency), in the dtype the rotated q and k have."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """Rotate [B, H, T, head_dim] by position (half-split layout)."""
    cos, sin = rotary
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def _residual_writer(in_features: int, config: ModelConfig, constrained: bool) -> nn.Module:
    if constrained:
        return SubspaceLinear(in_features, config.subspace_rank)
    return nn.Linear(in_features, config.d_model, bias=False)


def _write(layer: nn.Module, x: torch.Tensor, subspace: Subspace | None) -> torch.Tensor:
    return layer(x, subspace) if isinstance(layer, SubspaceLinear) else layer(x)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads (OLMo2 layout)."""

    def __init__(self, config: ModelConfig, constrained: bool) -> None:
        super().__init__()
        d, kv = config.d_model, config.kv_width
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        # QK-norm acts inside attention, never on the residual stream: it stays trainable per channel.
        self.q_norm = RMSNorm(d, config.norm_eps)
        self.k_norm = RMSNorm(kv, config.norm_eps)
        self.o_proj = _residual_writer(d, config, constrained)

    def forward(self, x: torch.Tensor, rotary: Rotary, subspace: Subspace | None) -> torch.Tensor:
        batch, seq, d = x.shape
        x = lower_precision(x)
        q = self.q_norm(self.q_proj(x)).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            apply_rotary(q, rotary),
            apply_rotary(k, rotary),
            v,
            is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return _write(self.o_proj, out.transpose(1, 2).reshape(batch, seq, d), subspace)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig, constrained: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = _residual_writer(config.ffn_hidden, config, constrained)

    def forward(self, x: torch.Tensor, subspace: Subspace | None) -> torch.Tensor:
        x = lower_precision(x)
        return _write(self.down_proj, F.silu(self.gate_proj(x)) * self.up_proj(x), subspace)


class Block(nn.Module):
    """h = h + norm(attn(h)); h = h + norm(mlp(h)) (OLMo2 reordering).

    constrained: the block's output crosses a stage boundary, so both residual writers map into
    span(U) and both output norms use a frozen scalar gain.
    """

    def __init__(self, config: ModelConfig, constrained: bool) -> None:
        super().__init__()
        self.constrained = constrained
        self.attn = Attention(config, constrained)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, trainable=not constrained)
        self.mlp = SwiGLU(config, constrained)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, trainable=not constrained)

    def forward(self, h: torch.Tensor, rotary: Rotary, subspace: Subspace | None) -> torch.Tensor:
        h = h + self.attn_norm(self.attn(h, rotary, subspace))
        return h + self.mlp_norm(self.mlp(h, subspace))
