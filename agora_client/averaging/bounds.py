"""Bounded influence of one SPARTA peer: how far a peer's numbers may pull ours.

A reducer bounds every sender's part against its own part before adding it to the average; a sender
bounds every averaged part a reducer sends back against what it sent. A peer that sends NaN, huge values
or noise thus moves an honest peer's slice by at most ``max_ratio`` times the norm of that slice part.
"""

from __future__ import annotations

import math

import torch

FLOOR_RMS = 1e-3  # parts whose own values are (near) zero, e.g. fresh biases, may still move this much per element
MAX_WEIGHT = 1.0  # SPARTA weights are 0 (receive only) or 1; a larger claimed weight counts as 1


def bounded(reference: torch.Tensor, value: torch.Tensor, max_ratio: float) -> tuple[torch.Tensor, str | None]:
    """``value`` pulled back to within ``max_ratio`` x ||reference|| of ``reference``, and what was wrong with it.

    Non-finite values are replaced by ``reference`` whole; a finite value too far away is moved along its
    difference onto the bound. Returns (value, None) when nothing was wrong. Math in float64: the squares of
    huge float32 values do not overflow there.
    """
    if value.shape != reference.shape:
        return reference.clone(), f"a part of shape {tuple(value.shape)} where {tuple(reference.shape)} was expected"
    if not bool(torch.isfinite(value).all()):
        return reference.clone(), "non-finite values"
    delta = value.double() - reference.double()
    limit = max_ratio * float(reference.double().norm()) + FLOOR_RMS * math.sqrt(reference.numel())
    norm = float(delta.norm())
    if norm <= limit:
        return value, None
    pulled = (reference.double() + delta * (limit / norm)).to(reference.dtype)
    return pulled, f"a difference {norm / limit:.3g}x the bound ({max_ratio} x the norm of our part)"


def bounded_weight(weight: float) -> float:
    """A sender's claimed averaging weight, within [0, MAX_WEIGHT]; NaN counts as 0."""
    return min(max(weight, 0.0), MAX_WEIGHT) if math.isfinite(weight) else (MAX_WEIGHT if weight > 0 else 0.0)
