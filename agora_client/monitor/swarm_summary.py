"""The swarm at the latest scrape, for the public page: per stage, workers active / syncing / queued, SPARTA round
success and spot-check standing; for the swarm, trainers' tokens/s and tokens seen.

Built from what one scrape read (verified metrics records, trainers' progress records) plus, when the monitor
knows the auth service, its per-stage queue lengths. Nothing here is credited: it describes, points do not depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agora_client.discovery.progress_records import CheckStanding, TrainerProgress
from agora_client.discovery.signed_records import MetricsRecord

# A kind of request is judged if any trainer can judge it; unverifiable beats calibrating: it will not change by
# waiting.
_STANDING_ORDER = ("verifiable", "unverifiable", "calibrating")


@dataclass(frozen=True)
class SpotCheckStatus:
    checks: int
    strikes: int
    bans: int
    forward: str  # verifiable, unverifiable or calibrating
    backward: str


@dataclass(frozen=True)
class StageSummary:
    stage: str
    active: int
    syncing: int  # in sync phase 1 or 2
    queued: int | None  # None: the monitor does not know the auth service
    sparta_rounds: int  # rounds the stage's live workers took part in
    sparta_success: float | None  # mean success rate over workers that ran a round; None before any
    spot_checks: SpotCheckStatus | None  # None: no trainer spot-checks this stage


@dataclass(frozen=True)
class SwarmSummary:
    updated_at: float  # monitor clock of the scrape
    tokens_per_s: float  # all live trainers together
    tokens_seen: int
    stages: tuple[StageSummary, ...] = field(default_factory=tuple)


class TokenTally:
    """Tokens the first stage's workers processed: live counters plus what finished runs had counted (this
    monitor process only: a worker's counter restarts with its run)."""

    def __init__(self) -> None:
        self._banked = 0
        self._last: dict[str, tuple[str, int]] = {}  # peer id -> (run id, tokens)

    def update(self, records: Iterable[MetricsRecord]) -> int:
        for record in records:
            run_id, tokens = self._last.get(record.peer_id, (record.run_id, 0))
            if run_id != record.run_id or record.tokens < tokens:
                self._banked += tokens
            self._last[record.peer_id] = (record.run_id, record.tokens)
        return self._banked + sum(tokens for _, tokens in self._last.values())


def stage_summary(
    stage: str, records: Sequence[MetricsRecord], progress: Sequence[TrainerProgress], queued: int | None
) -> StageSummary:
    averaged = [record for record in records if record.sparta_rounds > 0]
    return StageSummary(
        stage=stage,
        active=sum(record.sync_phase == "active" for record in records),
        syncing=sum(record.sync_phase in ("sync1", "sync2") for record in records),
        queued=queued,
        sparta_rounds=sum(record.sparta_rounds for record in records),
        sparta_success=sum(record.sparta_success_rate for record in averaged) / len(averaged) if averaged else None,
        spot_checks=spot_check_status(stage, progress),
    )


def spot_check_status(stage: str, progress: Sequence[TrainerProgress]) -> SpotCheckStatus | None:
    checks = [record.spot_checks[stage] for record in progress if stage in record.spot_checks]
    if not checks:
        return None
    return SpotCheckStatus(
        checks=sum(item.checks for item in checks),
        strikes=sum(item.strikes for item in checks),
        bans=sum(item.bans for item in checks),
        forward=_standing(item.forward for item in checks),
        backward=_standing(item.backward for item in checks),
    )


def _standing(standings: Iterable[CheckStanding]) -> str:
    states = {standing.state for standing in standings}
    return next(state for state in _STANDING_ORDER if state in states)


def summarize(
    stages: Sequence[str],
    records: Sequence[MetricsRecord],
    progress: Sequence[TrainerProgress],
    queued: dict[str, int] | None,
    tally: TokenTally,
    now: float,
) -> SwarmSummary:
    """The swarm as one scrape saw it; tokens seen are counted at the first of ``stages`` (every token passes it)."""
    by_stage = {stage: [record for record in records if record.stage == stage] for stage in stages}
    return SwarmSummary(
        updated_at=now,
        tokens_per_s=sum(record.tokens_per_s for record in progress),
        tokens_seen=tally.update(by_stage[stages[0]]) if stages else 0,
        stages=tuple(
            stage_summary(stage, by_stage[stage], progress, None if queued is None else queued.get(stage, 0))
            for stage in stages
        ),
    )
