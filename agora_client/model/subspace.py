"""Subspace Networks (Protocol Models, arXiv 2506.01260): the shared basis U and the frozen embedding E_f.

Every stage regenerates both from the run seed, so nothing is downloaded and nothing is trained,
averaged or snapshotted: they are non-persistent buffers, never parameters or state_dict entries.
The hidden state at every stage boundary is E_f[tokens] + c U^T, so only c (k per token) crosses.
"""

from __future__ import annotations

import torch
from torch import nn

from agora_client.config import ModelConfig
from agora_client.model.seeding import generator_for


def orthonormal_basis(d_model: int, rank: int, seed: int) -> torch.Tensor:
    """U (d x k, orthonormal columns): QR of a seeded float64 Gaussian on the CPU, signs fixed by R's diagonal."""
    gaussian = torch.randn(d_model, rank, dtype=torch.float64, generator=generator_for(seed, "subspace.basis"))
    q, r = torch.linalg.qr(gaussian)
    # QR is unique only up to column signs; a positive diag(R) pins it down on every LAPACK.
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(torch.float32)


def fixed_embedding(vocab_size: int, d_model: int, std: float, seed: int) -> torch.Tensor:
    """E_f (vocab x d): a frozen Gaussian table, full rank with probability one."""
    table = torch.randn(vocab_size, d_model, generator=generator_for(seed, "subspace.fixed_embedding"))
    return table.mul_(std)


class Subspace(nn.Module):
    """Holds U and E_f and maps a hidden state to its k subspace coefficients and back."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("basis", torch.empty(config.d_model, config.subspace_rank), persistent=False)
        self.register_buffer(
            "fixed_embedding", torch.empty(config.vocab_size, config.d_model), persistent=False
        )
        self._std = config.init_std

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    @torch.no_grad()
    def regenerate(self, seed: int) -> None:
        d_model, rank = self.basis.shape
        vocab_size = self.fixed_embedding.shape[0]
        self.basis.copy_(orthonormal_basis(d_model, rank, seed))
        self.fixed_embedding.copy_(fixed_embedding(vocab_size, d_model, self._std, seed))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """E_f[tokens]: [B, T] -> [B, T, d]."""
        return nn.functional.embedding(tokens, self.fixed_embedding)

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
