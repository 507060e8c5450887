"""How far a worker's copy of a SPARTA slice is from its group's average: the replica drift figure.

drift = ||local - average|| / ||average|| over the elements of one slice (relative L2), computed in float64.
A worker sees the group's average only of the slice it just averaged, so this is the one distance it can
measure without asking its peers for anything. For two workers of equal weight it is half their distance to
each other relative to their average: ||x1 - x2|| / ||x1 + x2||.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def relative_l2(values: torch.Tensor, reference: torch.Tensor) -> float | None:
    """||values - reference|| / ||reference||; None where it is not a number (a zero or non-finite reference)."""
    values, reference = values.detach().double().reshape(-1), reference.detach().double().reshape(-1)
    scale = float(reference.norm())
    if scale == 0 or not math.isfinite(scale):
        return None
    distance = float((values - reference).norm()) / scale
    return distance if math.isfinite(distance) else None


@dataclass(frozen=True)
class SliceDrift:
    """One round's drift of this worker's slice from its group's average, before and after the round's update.

    before: the slice as this worker sent it, against the group's (weighted) average of what everyone sent.
    after: the slice as it stands in the parameters right after the update, against the same average; it is
    not 0 when training stepped while the round was in flight (that movement is where the next drift starts).
    Elements no peer's data reached, or whose average was not a number, kept their local values and count as
    agreeing: the round's ``fraction`` says how much of the slice that was.
    """

    before: float | None
    after: float | None
