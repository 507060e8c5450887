"""The outer step on SPARTA's averaged slices (averaging/outer_momentum.py): its arithmetic, round by round."""

from __future__ import annotations

import pytest
import torch

from agora_client.averaging.outer_momentum import OuterMomentum
from agora_client.averaging.partition import StridedPartition
from agora_client.config import ConfigError, SpartaConfig, load_config
from agora_client.model.memory import FP32, outer_step_bytes


def _rounds(seed: int, count: int, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sent, the group's average) of ``count`` rounds over one slice: the slice moved on between rounds."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, generator=generator), torch.randn(size, generator=generator)) for _ in range(count)]


def _reference_targets(rounds: list[tuple[torch.Tensor, torch.Tensor]], mu: float, eta: float) -> list[torch.Tensor]:
    """DiLoCo's Nesterov outer step, element by element in float64: the first round adopts the average."""
    anchor, momentum, targets = None, None, []
    for _, average in rounds:
        average = average.double()
        if anchor is None:
            anchor, momentum = average.clone(), torch.zeros_like(average)
        else:
            gradient = anchor - average
            momentum = mu * momentum + gradient
            anchor = anchor - eta * (gradient + mu * momentum)
        targets.append(anchor)
    return targets


def test_the_first_round_over_a_slice_adopts_the_average() -> None:
    outer = OuterMomentum(0.9, 0.7)
    ((sent, average),) = _rounds(0, 1)
    assert torch.equal(outer.delta(0, sent, average), average - sent)


@pytest.mark.parametrize("mu, eta", [(0.9, 0.7), (0.5, 1.0), (0.0, 0.5), (0.0, 1.0)])
def test_every_round_moves_the_slice_to_the_nesterov_target(mu: float, eta: float) -> None:
    outer, rounds = OuterMomentum(mu, eta), _rounds(1, 5)
    for (sent, average), target in zip(rounds, _reference_targets(rounds, mu, eta), strict=True):
        delta = outer.delta(0, sent, average)
        # the delta is taken from what was sent: training that stepped meanwhile stays in the live slice
        torch.testing.assert_close((sent + delta).double(), target, rtol=1e-6, atol=1e-6)


def test_no_momentum_and_a_unit_step_is_plain_averaging() -> None:
    outer = OuterMomentum(0.0, 1.0)
    for sent, average in _rounds(2, 4):
        torch.testing.assert_close(sent + outer.delta(0, sent, average), average, rtol=0, atol=1e-6)
    # and the config's defaults build no outer step at all, so the averager's arithmetic is today's, bit for bit
    assert not SpartaConfig().outer_step and not SpartaConfig(outer_momentum=0.0, outer_lr=1.0).outer_step
    assert SpartaConfig(outer_momentum=0.9).outer_step and SpartaConfig(outer_lr=0.7).outer_step


def test_a_second_round_steps_past_the_average_by_the_momentum() -> None:
    outer = OuterMomentum(0.5, 1.0)
    sent = torch.zeros(3)
    outer.delta(0, sent, torch.full((3,), 1.0))  # anchor 1
    # g = 1 - 3 = -2; m = -2; t = 1 - (-2 + 0.5 x -2) = 4
    assert torch.equal(sent + outer.delta(0, sent, torch.full((3,), 3.0)), torch.full((3,), 4.0))
    # g = 4 - 5 = -1; m = 0.5 x -2 - 1 = -2; t = 4 - (-1 + 0.5 x -2) = 6
    assert torch.equal(sent + outer.delta(0, sent, torch.full((3,), 5.0)), torch.full((3,), 6.0))


def test_replicas_that_averaged_together_land_on_the_same_values() -> None:
    mine, theirs = OuterMomentum(0.9, 0.7), OuterMomentum(0.9, 0.7)
    for index, (_, average) in enumerate(_rounds(3, 4)):
        # each replica stepped on its own share of the batch since the last round: they sent different values
        sent_mine, sent_theirs = average + 0.1 * (index + 1), average - 0.2 * (index + 1)
        landed_mine = sent_mine + mine.delta(0, sent_mine, average)
        landed_theirs = sent_theirs + theirs.delta(0, sent_theirs, average)
        torch.testing.assert_close(landed_mine, landed_theirs, rtol=0, atol=1e-6)
    assert not torch.allclose(landed_mine, average)  # the step went past the average, both replicas alike


def test_slices_keep_their_own_anchors_and_momenta() -> None:
    together, apart = OuterMomentum(0.9, 0.7), [OuterMomentum(0.9, 0.7), OuterMomentum(0.9, 0.7)]
    first, second = _rounds(4, 3), _rounds(5, 3)
    for (sent_a, average_a), (sent_b, average_b) in zip(first, second, strict=True):
        assert torch.equal(together.delta(0, sent_a, average_a), apart[0].delta(0, sent_a, average_a))
        assert torch.equal(together.delta(1, sent_b, average_b), apart[1].delta(0, sent_b, average_b))


def test_replaced_parameters_start_the_slices_over() -> None:
    outer, fresh = OuterMomentum(0.9, 0.7), OuterMomentum(0.9, 0.7)
    for sent, average in _rounds(6, 3):
        outer.delta(0, sent, average)
    outer.parameters_replaced()
    for sent, average in _rounds(7, 3):  # as if it had never averaged: plain first, then the same steps
        assert torch.equal(outer.delta(0, sent, average), fresh.delta(0, sent, average))


def test_a_slice_of_another_size_is_refused_with_the_way_out() -> None:
    outer = OuterMomentum(0.9, 0.7)
    outer.delta(0, torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError, match=r"slice 0 has 5 values but its anchor has 4.*parameters_replaced"):
        outer.delta(0, torch.zeros(5), torch.ones(5))


@pytest.mark.parametrize("mu, eta, floats", [(0.9, 0.7, 2), (0.0, 0.5, 1)])
def test_memory_is_taken_per_slice_averaged_and_matches_the_plan(mu: float, eta: float, floats: int) -> None:
    layout = StridedPartition([7, 10, 3], 4)
    outer = OuterMomentum(mu, eta)
    assert outer.nbytes == 0
    outer.delta(2, torch.zeros(layout.slice_size(2)), torch.ones(layout.slice_size(2)))
    assert outer.nbytes == floats * FP32 * layout.slice_size(2)
    for part in range(layout.num_partitions):
        outer.delta(part, torch.zeros(layout.slice_size(part)), torch.ones(layout.slice_size(part)))
    sparta = SpartaConfig(outer_momentum=mu, outer_lr=eta)
    # the plan also counts the slice a step computes on
    assert outer_step_bytes(layout.total, layout.max_slice_size, sparta) == outer.nbytes + layout.max_slice_size * FP32


@pytest.mark.parametrize("mu, eta", [(-0.1, 1.0), (1.0, 1.0), (0.9, 0.0)])
def test_out_of_range_settings_are_refused(mu: float, eta: float) -> None:
    with pytest.raises(ValueError, match="outer"):
        OuterMomentum(mu, eta)
    with pytest.raises(ConfigError, match="outer_"):
        load_config("tiny", {"sparta": {"outer_momentum": mu, "outer_lr": eta}})
