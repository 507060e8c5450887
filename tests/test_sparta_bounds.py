"""Bounded influence of one SPARTA peer (averaging/bounds.py)."""

from __future__ import annotations

import math

import torch

from agora_client.averaging.bounds import FLOOR_RMS, MAX_WEIGHT, bounded, bounded_weight

OWN = torch.linspace(-1.0, 1.0, 1000)


def _limit(ratio: float) -> float:
    return ratio * float(OWN.norm()) + FLOOR_RMS * math.sqrt(OWN.numel())


def test_a_close_part_passes_unchanged() -> None:
    near = OWN + 0.01
    value, problem = bounded(OWN, near, 0.5)
    assert problem is None and value is near


def test_non_finite_parts_are_replaced_by_our_own() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = OWN.clone()
        poisoned[17] = bad
        value, problem = bounded(OWN, poisoned, 0.5)
        assert problem == "non-finite values" and torch.equal(value, OWN)


def test_huge_and_noisy_parts_are_pulled_onto_the_bound() -> None:
    for far in (
        torch.full_like(OWN, 3e38),
        OWN + torch.randn(OWN.shape, generator=torch.Generator().manual_seed(0)) * 100,
    ):
        value, problem = bounded(OWN, far, 0.5)
        assert problem is not None and "x the bound" in problem
        assert bool(torch.isfinite(value).all())
        distance = float((value.double() - OWN.double()).norm())
        assert distance <= _limit(0.5) * (1 + 1e-5) and distance >= _limit(0.5) * (1 - 1e-3), "moved onto the bound"
        direction = torch.nn.functional.cosine_similarity((value - OWN).double(), (far - OWN).double(), dim=0)
        assert float(direction) > 0.999, "pulled back along its own difference"


def test_zero_parts_may_still_move_a_little() -> None:
    zeros = torch.zeros(400)
    value, problem = bounded(zeros, torch.full_like(zeros, 1e-4), 0.5)
    assert problem is None and torch.equal(value, torch.full_like(zeros, 1e-4))


def test_a_part_of_the_wrong_shape_is_replaced() -> None:
    value, problem = bounded(OWN, torch.zeros(10), 0.5)
    assert "shape" in (problem or "") and torch.equal(value, OWN)


def test_claimed_weights_are_bounded() -> None:
    assert [bounded_weight(w) for w in (0.0, 0.5, 1.0, 1e9, -3.0, float("nan"), float("inf"))] == [
        0.0,
        0.5,
        1.0,
        MAX_WEIGHT,
        0.0,
        0.0,
        MAX_WEIGHT,
    ]
