"""Subspace Networks (Protocol Models, arXiv 2506.01260): the shared basis U and the frozen embedding E_f.

Every stage regenerates both from the run seed, so nothing is downloaded and nothing is trained,
averaged or snapshotted: U is a non-persistent buffer (d x k, 1 MB at 8b), never a parameter or a
state_dict entry. E_f (vocab x d, 2.6 GB in fp32 at 8b) is never stored: each row is a counter-based
hash of (seed, token, column), generated on the stage's device for the tokens of the microbatch.
The hidden state at every stage boundary is E_f[tokens] + c U^T, so only c (k per token) crosses.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agora_client.config import ModelConfig
from agora_client.model.seeding import derived_seed, generator_for


def orthonormal_basis(d_model: int, rank: int, seed: int) -> torch.Tensor:
    """U (d x k, orthonormal columns): QR of a seeded float64 Gaussian on the CPU, signs fixed by R's diagonal."""
    gaussian = torch.randn(d_model, rank, dtype=torch.float64, generator=generator_for(seed, "subspace.basis"))
    q, r = torch.linalg.qr(gaussian)
    # QR is unique only up to column signs; a positive diag(R) pins it down on every LAPACK.
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(torch.float32)


_MASK32 = 0xFFFFFFFF
ROWS_PER_CHUNK = 256  # E_f rows hashed at once: bounds the int64 scratch to 256 * d * 8 B per tensor


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), in int64 without overflow (split x in 16-bit halves)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + ((high * (constant & 0xFFFF)) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (the 'lowbias32' constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """(0, 1) from the top 24 bits: exact in float32, never 0 so log() is finite."""
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def fixed_embedding_rows(tokens: torch.Tensor, d_model: int, std: float, seed: int) -> torch.Tensor:
    """E_f[tokens] ([..., d], float32, on tokens' device): Gaussian rows from (seed, token, column) alone."""
    # A microbatch repeats its tokens (tiny: 1024 tokens over a 256-token vocabulary): each distinct row is hashed once.
    distinct, where = torch.unique(tokens.reshape(-1), return_inverse=True)
    return _hashed_rows(distinct, d_model, std, seed)[where].view(*tokens.shape, d_model)


def _hashed_rows(rows: torch.Tensor, d_model: int, std: float, seed: int) -> torch.Tensor:
    key_row, key_column, key_radius, key_angle = (
        derived_seed(seed, f"subspace.fixed_embedding.{part}") & _MASK32
        for part in ("row", "column", "radius", "angle")
    )
    # Hashed columns: a row pair whose hashes differ by a small XOR cannot share permuted cells.
    columns = _mix32(torch.arange(d_model, dtype=torch.int64, device=rows.device) ^ key_column)
    out = torch.empty(rows.numel(), d_model, dtype=torch.float32, device=rows.device)
    for start in range(0, rows.numel(), ROWS_PER_CHUNK):
        cell = _mix32(_mix32(rows[start : start + ROWS_PER_CHUNK, None] ^ key_row) ^ columns)
        radius = torch.sqrt(-2.0 * torch.log(_uniform(_mix32(cell ^ key_radius))))  # Box-Muller
        angle = (2.0 * math.pi) * _uniform(_mix32(cell ^ key_angle))
        out[start : start + ROWS_PER_CHUNK] = radius * torch.cos(angle) * std
    return out


def fixed_embedding(vocab_size: int, d_model: int, std: float, seed: int) -> torch.Tensor:
    """The whole E_f table (vocab x d), e.g. for exporting the model; stages never build it."""
    return fixed_embedding_rows(torch.arange(vocab_size), d_model, std, seed)


class Subspace(nn.Module):
    """Holds U and the seed of E_f and maps a hidden state to its k subspace coefficients and back."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("basis", torch.empty(config.d_model, config.subspace_rank), persistent=False)
        self._std = config.init_std
        self._seed: int | None = None  # set by regenerate(); E_f rows need it

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    @torch.no_grad()
    def regenerate(self, seed: int) -> None:
        d_model, rank = self.basis.shape
        self.basis.copy_(orthonormal_basis(d_model, rank, seed))
        self._seed = seed

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """E_f[tokens]: [B, T] -> [B, T, d] (float32; on the meta device, shaped zeros)."""
        if tokens.is_meta:
            return torch.empty(*tokens.shape, self.basis.shape[0], device="meta")
        if self._seed is None:
            raise RuntimeError("the subspace was never generated: build stages with build_stage()")
        return fixed_embedding_rows(tokens, self.basis.shape[0], self._std, self._seed)

    def lift(self, coefficients: torch.Tensor) -> torch.Tensor:
        """c U^T: [..., k] -> [..., d], a vector in span(U)."""
        return coefficients @ self.basis.T

    def compress(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """c = (h - E_f[tokens]) U: what a stage sends downstream instead of h."""
        return (hidden - self.embed(tokens)) @ self.basis

    def expand(self, coefficients: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """h = c U^T + E_f[tokens]: what the receiving stage rebuilds."""
        return self.lift(coefficients) + self.embed(tokens)


class SubspaceLinear(nn.Module):
    """A linear map whose output lies in span(U): W = W' U^T with W' of width k.

    Reparametrization rather than projecting W onto span(U) after every optimizer step: the
    constraint then holds exactly by construction for every forward, the optimizer (AdamW, weight
    decay, SPARTA averaging) needs no hook, and the trainable state shrinks from d to k columns.
    """

    def __init__(self, in_features: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rank, in_features))  # W'^T in (out, in) layout

    def forward(self, x: torch.Tensor, subspace: Subspace) -> torch.Tensor:
        return subspace.lift(nn.functional.linear(x, self.weight))
