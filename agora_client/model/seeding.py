"""Deterministic random streams named by (run seed, what they initialize)."""

from __future__ import annotations

import hashlib

import torch


def derived_seed(seed: int, name: str) -> int:
    # sha256, not hash(): Python salts str hashes per process, and every worker must agree.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator_for(seed: int, name: str) -> torch.Generator:
    """A CPU generator whose stream depends only on the run seed and the name."""
    return torch.Generator(device="cpu").manual_seed(derived_seed(seed, name))
