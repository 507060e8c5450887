"""Rotating SPARTA slices of a stage's flat parameter vector.

The flat vector is the concatenation of the stage's trainable parameters in a fixed order.
It is cut into P = round(1 / fraction) non-overlapping slices; round r averages slice r mod P,
so P consecutive rounds cover every parameter exactly once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Segment:
    """The elements one parameter contributes to one slice.

    flat[start::stride][:count] -> buffer[offset:offset+count]."""

    tensor_index: int
    start: int
    count: int
    offset: int


class StridedPartition:
    """Element i of the flat vector belongs to slice i mod P.

    Strided rather than contiguous chunks: every slice touches every tensor evenly (a round pulls
    all layers together a little instead of one layer fully), slices differ in size by at most one
    element, and the layout follows from the parameter sizes alone, so every peer computes the same
    slices on any device and dtype without an RNG.
    """

    def __init__(self, sizes: Sequence[int], num_partitions: int):
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be at least 1, got {num_partitions}")
        if not sizes or any(size < 0 for size in sizes):
            raise ValueError("a partition needs at least one tensor and no negative sizes")
        self.sizes = tuple(int(size) for size in sizes)
        self.num_partitions = num_partitions
        self.total = sum(self.sizes)
        self._segments = tuple(self._layout(part) for part in range(num_partitions))

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], num_partitions: int) -> "StridedPartition":
        for index, tensor in enumerate(tensors):
            if not tensor.is_contiguous():
                raise ValueError(f"parameter #{index} is not contiguous; SPARTA slices need flat views of parameters")
        return cls([tensor.numel() for tensor in tensors], num_partitions)

    def _layout(self, part: int) -> tuple[Segment, ...]:
        segments, global_offset, buffer_offset = [], 0, 0
        for index, size in enumerate(self.sizes):
            start = (part - global_offset) % self.num_partitions
            count = len(range(start, size, self.num_partitions))
            if count:
                segments.append(Segment(index, start, count, buffer_offset))
                buffer_offset += count
            global_offset += size
        return tuple(segments)

    def segments(self, part: int) -> tuple[Segment, ...]:
        return self._segments[part]

    def slice_size(self, part: int) -> int:
        return len(range(part, self.total, self.num_partitions))

    @property
    def max_slice_size(self) -> int:
        return self.slice_size(0)

    @property
    def fingerprint(self) -> bytes:
        """Identical for peers that slice identically; peers with another layout must never be grouped."""
        return hashlib.blake2b(repr((self.sizes, self.num_partitions)).encode(), digest_size=16).digest()

    def _views(self, tensors: Sequence[torch.Tensor], part: int):
        if len(tensors) != len(self.sizes):
            raise ValueError(f"expected {len(self.sizes)} tensors, got {len(tensors)}")
        for segment in self._segments[part]:
            flat = tensors[segment.tensor_index].detach().view(-1)
            yield segment, flat[segment.start :: self.num_partitions]

    @torch.no_grad()
    def gather(self, tensors: Sequence[torch.Tensor], part: int, out: torch.Tensor) -> None:
        """Copy slice `part` of the tensors into out[:slice_size(part)], converting to out's dtype and device."""
        for segment, view in self._views(tensors, part):
            out[segment.offset : segment.offset + segment.count].copy_(view)

    @torch.no_grad()
    def add_(self, tensors: Sequence[torch.Tensor], part: int, delta: torch.Tensor) -> None:
        """tensors[slice part] += delta[:slice_size(part)], in place, in each tensor's own dtype and device."""
        for segment, view in self._views(tensors, part):
            chunk = delta[segment.offset : segment.offset + segment.count]
            view.add_(chunk.to(device=view.device, dtype=view.dtype))


def partition_of(round_no: int, num_partitions: int) -> int:
    return round_no % num_partitions


def due_round(epoch: int, period: int, since: int | None = None) -> int | None:
    """The round due when the stage epoch moves from ``since`` (default: epoch - 1) to ``epoch``, or None.

    Round n starts at epoch n x period (n >= 1). A worker whose epoch jumps over that boundary (it caught up
    with its stage by more than one epoch) still starts the latest round it crossed, with its peers.
    """
    since = epoch - 1 if since is None else since
    latest = epoch // period
    if latest >= 1 and latest * period > since:
        return latest
    return None
