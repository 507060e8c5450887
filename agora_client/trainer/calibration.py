"""How far apart honest answers are, per stage and kind of request, and the spot checks' tolerance that follows.

Honest replicas of a stage drift apart (SPARTA keeps them close, not equal), and each stage drifts its own
way: head replicas of the tiny preset 0.93-1.22 apart, the tail 0.04-0.26. So each stage and kind of request
(forward outputs and backward gradients drift differently) keeps a bounded window of recent distances
between answers known to be honest, and judges with a tolerance of a high quantile of that window plus a
margin.

Which answers are known to be honest, without a tolerance to tell? Those of the closest pair among three
answers to one request, if at most one of the three workers lies. An answer that was not computed (random
tensors, of any scale) is at least sqrt(2) from each honest one, farther than honest answers are from each
other: so that liar is never in the closest pair. A liar that is (it answered closer to an honest answer
than the other honest one did) records a distance smaller than an honest one: it can only tighten the
tolerance. The third answer's two distances are honest samples too when it lies no farther than
``CONSISTENT_RATIO`` times the pair's distance from both and clearly closer than random answers: without
them every sample would be the smallest of three honest distances, and the tolerance too tight for the
stage's other pairs. So a liar widens a tolerance only by answering within twice the honest drift of the
truth, which random tensors, zeros or rescaled noise never do.

Three answers come from calibration checks (the spot checker asks a third worker on every check while a
stage has fewer than ``min_samples`` distances, then on a ``calibration_share`` of them, at random: the
window keeps following the drift as training goes on) and from referee rounds. A referee round happens
because a pair disagreed: it adds samples just when the drift has outgrown the tolerance, which raises
the tolerance rather than striking honest workers. A worker cannot tell a check, a calibration or a
referee request from any other request: it cannot answer honestly on those alone.

A stage and kind is ``calibrating`` until it has ``min_samples`` distances, and ``unverifiable`` while its
tolerance comes within ``margin`` of random answers' distance: there output comparison cannot tell a
liar from an honest replica, so its disagreements strike no one. Otherwise it is ``verifiable``.

Drift grows as training goes on, faster than the window follows it, and unevenly: one replica may lag its
stage's averaging and stand twice as far from the other two as they stand from each other. Such an answer is
beyond the tolerance, and not trusted as a sample either. So an answer beyond the tolerance takes a strike only
when it is farther from the referee's than ``strike_distance``: ``CONSISTENT_RATIO`` times the tolerance (farther
than a third answer the calibration would trust), at most random answers' distance less the margin, which
random tensors of any scale always exceed. In between it is a disagreement that blames no one (measured: with
the tolerance alone, 3 honest body1 workers took a strike each within 6 minutes of a tiny swarm checking 30%).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence

from agora_client.config import SpotCheckConfig
from agora_client.discovery.progress_records import CheckStanding

RANDOM_DISTANCE = math.sqrt(2)  # independent answers of equal norm; farther at any other scale (see relative_distance)
CONSISTENT_RATIO = 2.0  # a third answer this much farther from the closest pair than they are apart is not trusted


def confirmed_distances(distances: Sequence[float], margin: float) -> list[float]:
    """The honest distances among the three pairwise distances of three answers, at most one of them a lie."""
    pair, *third = sorted(distances)
    if len(third) != 2 or not math.isfinite(pair):
        return []
    consistent = all(d <= CONSISTENT_RATIO * pair and d < RANDOM_DISTANCE - margin for d in third)
    return [pair, *third] if consistent else [pair]


def strike_distance(tolerance: float, margin: float) -> float:
    """How far from the referee's answer an answer beyond ``tolerance`` must be to earn a strike."""
    return min(CONSISTENT_RATIO * tolerance, RANDOM_DISTANCE - margin)


class Calibration:
    """One stage and kind of request: its recent honest distances and the standing they give it."""

    def __init__(self, config: SpotCheckConfig):
        self.config = config
        self._distances: deque[float] = deque(maxlen=config.window)

    def wants_third_answer(self, rng: random.Random) -> bool:
        """Whether this check should also ask a third worker, to measure honest drift."""
        return len(self._distances) < self.config.min_samples or rng.random() < self.config.calibration_share

    def add(self, distances: Sequence[float]) -> None:
        self._distances.extend(distances)

    def standing(self) -> CheckStanding:
        samples = len(self._distances)
        if samples < self.config.min_samples:
            return CheckStanding(state="calibrating", samples=samples)
        ordered = sorted(self._distances)
        tolerance = ordered[max(0, math.ceil(self.config.quantile * samples) - 1)] + self.config.margin
        judged = tolerance < RANDOM_DISTANCE - self.config.margin
        return CheckStanding(state="verifiable" if judged else "unverifiable", tolerance=tolerance, samples=samples)


def describe(stage: str, kind: str, standing: CheckStanding, margin: float) -> str:
    """A log line for a stage and kind whose standing just changed."""
    where = f"{stage} {kind}"
    if standing.state == "calibrating":
        return f"{where}: calibrating ({standing.samples} honest distances so far); its disagreements strike no one"
    if standing.state == "verifiable":
        return f"{where}: verifiable, tolerance {standing.tolerance:.3f} from {standing.samples} honest distances"
    return (
        f"{where}: unverifiable, honest replicas drift to a tolerance of {standing.tolerance:.3f}, within "
        f"{margin:g} of random answers' {RANDOM_DISTANCE:.3f}; its disagreements strike no one until it drifts "
        "less"
    )
