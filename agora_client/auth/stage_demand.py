"""How many workers each stage should have: the stages are staffed by demand, not by fill order.

A stage's throughput is the sum of its workers' speeds over its compute per microbatch; the pipeline runs at its
slowest stage's. The auth service does not know a joiner's speed, so every worker counts as one; the compute per
microbatch is the run's plan (``model.memory.flops_per_microbatch``: forward plus the recomputing backward). A stage's
target is the share of workers its compute asks for, scaled so that the heaviest stage's target is the most a stage
may hold; the operator may set any stage's target instead (``--stage-target STAGE=N``). The slot book gives a joiner
the stage it can hold with the fewest workers for its target (``fill``), ties to pipeline order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from agora_client.config import RunConfig

Source = Literal["plan", "operator", "even"]


@dataclass(frozen=True)
class StageNeed:
    stage: str
    target: float  # the workers the stage should have (> 0)
    source: Source  # "plan": from its compute; "operator": --stage-target; "even": no plan, every stage alike
    flops_per_microbatch: int | None = None  # the plan's, where there is a plan


@dataclass(frozen=True)
class StageDemand:
    needs: tuple[StageNeed, ...]

    def __post_init__(self) -> None:
        if any(need.target <= 0 for need in self.needs):
            raise ValueError("every stage's target workers must be positive")

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(need.stage for need in self.needs)

    def fill(self, stage: str, workers: int) -> float:
        """``workers`` over the stage's target: the lower, the more the pipeline waits on this stage."""
        return workers / next(need.target for need in self.needs if need.stage == stage)

    def to_json(self) -> dict[str, dict[str, object]]:
        return {
            need.stage: {
                "target_workers": round(need.target, 2),
                "source": need.source,
                "flops_per_microbatch": need.flops_per_microbatch,
            }
            for need in self.needs
        }


def even_demand(stages: Sequence[str], most: int) -> StageDemand:
    """Every stage alike (no plan to weigh them by): the book fills the stage with the fewest workers."""
    return StageDemand(tuple(StageNeed(stage, float(most), "even") for stage in stages))


def plan_demand(flops: Mapping[str, int], most: int, overrides: Mapping[str, int] | None = None) -> StageDemand:
    """Targets from each stage's FLOPs per microbatch (in pipeline order), the heaviest stage's target ``most``;
    the operator's ``overrides`` replace the plan's target of the stages they name."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(flops))
    if unknown:
        raise ValueError(
            f"--stage-target names no stage of this run: {', '.join(unknown)} (stages: {', '.join(flops)})"
        )
    for stage, target in overrides.items():
        if not 1 <= target <= most:
            raise ValueError(
                f"--stage-target {stage}={target}: a target must be a whole number of workers from 1 to the "
                f"most a stage may hold ({most}, --max-workers-per-stage)"
            )
    heaviest = max(flops.values())
    return StageDemand(
        tuple(
            StageNeed(stage, float(overrides[stage]), "operator", work)
            if stage in overrides
            else StageNeed(stage, most * work / heaviest, "plan", work)
            for stage, work in flops.items()
        )
    )


def run_demand(run: RunConfig, most: int, overrides: Mapping[str, int] | None = None) -> StageDemand:
    """The run's demand: its plan's compute per stage at its microbatch, with the operator's overrides."""
    from agora_client.model.memory import flops_per_microbatch  # imports torch: only the service that plans needs it

    microbatch = run.optim.microbatch_size
    flops = {stage: flops_per_microbatch(run.model, stage, microbatch) for stage in run.model.stage_names}
    return plan_demand(flops, most, overrides)


def parse_stage_targets(items: Sequence[str]) -> dict[str, int]:
    """``["tail=6", ...]`` (``--stage-target``) as {stage: workers}; ValueError says what is wrong."""
    targets: dict[str, int] = {}
    for item in items:
        stage, sep, value = item.partition("=")
        stage = stage.strip()
        if not sep or not stage or not value.strip().isdigit():
            raise ValueError(f"--stage-target {item!r} is not STAGE=N (a stage name and a whole number of workers)")
        if stage in targets:
            raise ValueError(f"--stage-target names stage {stage} twice")
        targets[stage] = int(value)
    return targets
