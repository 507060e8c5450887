"""An outer step on SPARTA's averaged slices, in the manner of DiLoCo (sparta.outer_momentum, sparta.outer_lr).

For every partition p this worker keeps an anchor a_p: the slice's value right after its last averaging, as
applied. With momentum μ > 0 it also keeps a momentum buffer m_p. A round that averaged slice p to the group's
average ā takes one Nesterov step of size η:
    g    = a_p - ā                 the outer gradient: where the slice was left, minus where the group took it
    m_p <- μ m_p + g
    t    = a_p - η (g + μ m_p)
    a_p <- t
The live slice then moves by t - sent (sent: the slice as it went out; training kept stepping while the round
was in flight, which the delta keeps, as plain averaging's does). μ = 0 with η = 1 gives t = ā: plain averaging.
The first round over a slice, and the first after the parameters were replaced wholesale, averages plainly and
sets the anchor to ā (momentum 0). A round that left some elements unaveraged takes no step (sparta.py): it
averages plainly and leaves anchor and momentum as they were, since the engine reports how many elements it left
out, not which. Replicas that averaged a slice together from the same anchor compute the same g and t, so the
step does not pull them apart (up to what a lossy payload or a bounded peer changes in ā).

Host memory: per slice, allocated the first time a round averages it: the anchor, and the momentum when μ > 0.
That is 8 bytes per trainable parameter (4 with μ = 0) once every slice has been averaged, plus one slice while
a step is computed. Only the round thread may call delta; parameters_replaced may be called from any thread.
"""

from __future__ import annotations

import torch


class OuterMomentum:
    """Per SPARTA partition: the anchor and momentum of the outer step (see the module's docstring)."""

    def __init__(self, momentum: float, lr: float):
        if not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must be at least 0 and below 1, got {momentum}")
        if not lr > 0:
            raise ValueError(f"outer lr must be above 0, got {lr}")
        self._momentum, self._lr = momentum, lr
        self._anchors: dict[int, torch.Tensor] = {}
        self._momenta: dict[int, torch.Tensor] = {}
        self._replaced = False

    @torch.no_grad()
    def delta(self, partition: int, sent: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        """What to add to the live slice ``partition`` after a round that averaged every element of it: the outer
        step's target minus ``sent``. ``average``: the group's average ā (float32, the slice's size). A new tensor."""
        if self._replaced:
            self._replaced = False
            self._anchors.clear()
            self._momenta.clear()
        anchor = self._anchors.get(partition)
        if anchor is not None and anchor.shape != average.shape:
            raise ValueError(
                f"slice {partition} has {average.numel()} values but its anchor has {anchor.numel()}: the partition "
                "layout changed; call parameters_replaced() after changing the parameters or num_partitions"
            )
        if anchor is None:  # nothing to step from yet: adopt the average, as plain averaging does
            self._anchors[partition] = average.detach().clone()
            if self._momentum > 0:
                self._momenta[partition] = torch.zeros_like(average)
            return average - sent
        step = anchor - average  # g
        momentum = self._momenta.get(partition)
        if momentum is not None:
            momentum.mul_(self._momentum).add_(step)
            step.add_(momentum, alpha=self._momentum)  # Nesterov: g + μ m
        anchor.sub_(step, alpha=self._lr)  # the anchor becomes the target t
        return anchor - sent

    def parameters_replaced(self) -> None:
        """The parameters were loaded wholesale: the anchors no longer describe them. Any thread; the round thread
        forgets anchors and momenta before its next step."""
        self._replaced = True

    @property
    def nbytes(self) -> int:
        """Host memory the anchors and momenta hold now."""
        return sum(
            tensor.numel() * tensor.element_size() for tensor in [*self._anchors.values(), *self._momenta.values()]
        )
