"""The swarm view: each stage's workers (active, syncing, queued) and replica drift, the global throughput, and for
this worker's stage its share of the work, its SPARTA health and the trainers' spot checks."""

from __future__ import annotations

from textual.markup import escape
from textual.widget import Widget

from agora_client.events import SpotCheckStatus, StageSwarm, SwarmEvent
from agora_client.frontend.lines import drift_percent
from tui.widgets.figures import SpartaTally

_HEADER = f"[$text-muted]{'stage':<10}{'active':>7}{'syncing':>8}{'queued':>7}{'of':>5}{'drift':>8}  spot checks[/]"
_ASSURANCE = {
    "verifiable": "[$text-success]✔ verifiable[/]",
    "calibrating": "[$text-accent]● calibrating[/]",
    "unverifiable": "[$text-warning]▲ unverifiable[/]",
}
HEALTHY, DEGRADED = 0.8, 0.5  # shares of SPARTA rounds ok from which a stage's averaging is healthy / degraded


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _drift(value: float | None) -> str:
    """The stage's replica drift as a percent; "–" before any of its workers has averaged."""
    return "–" if value is None else drift_percent(value)


def spot_text(checks: SpotCheckStatus | None, full: bool = False) -> str:
    """The trainers' spot checks on a stage: their standing and count; ``full`` adds the strikes and bans they gave."""
    if checks is None:
        return "[$text-muted]none[/]"
    if not full:
        return f"{_ASSURANCE[checks.state]} {checks.checks}"
    penalties = f"{_plural(checks.strikes, 'strike')} · {_plural(checks.bans, 'ban')}"
    if checks.strikes or checks.bans:
        penalties = f"[$text-error]{penalties}[/]"
    return f"{checks.checks} checks · {penalties} · {_ASSURANCE[checks.state]}"


def stage_row(stage: StageSwarm, mine: bool) -> str:
    name = f"› {stage.stage}" if mine else f"  {stage.stage}"
    aside = f" [$text-error]+{stage.unhealthy} unhealthy[/]" if stage.unhealthy else ""
    aside += f" [$text-muted]+{stage.yielding} yielding[/]" if stage.yielding else ""
    row = (
        f"{escape(name):<10}{stage.active:>7}{stage.syncing:>8}{_count(stage.queued):>7}{_count(stage.capacity):>5}"
        f"{_drift(stage.drift):>8}  {spot_text(stage.spot_checks)}{aside}"
    )
    return f"[b]{row}[/]" if mine else row


def sparta_health(tally: SpartaTally, active: int | None) -> str:
    """This worker's rounds as the sign of its stage's averaging health; the last group against the stage's workers."""
    if not tally.total:
        return "[$text-muted]no round yet[/]"
    rate = tally.ok / tally.total
    verdict = (
        "[$text-success]✔ healthy[/]"
        if rate >= HEALTHY
        else "[$text-warning]▲ degraded[/]"
        if rate >= DEGRADED
        else "[$text-error]✖ failing[/]"
    )
    last = tally.last
    group = f" · last group {last.group_size}" + (f" of {active} active" if active else "") if last and last.ok else ""
    return f"{verdict} · {tally.ok}/{tally.total} rounds ok ({rate:.0%}){group}"


class StagesPanel(Widget):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.swarm: SwarmEvent | None = None
        self.share: float | None = None  # this worker's share of its stage's samples (moving mean over recent epochs)
        self.tally = SpartaTally()

    def on_mount(self) -> None:
        self.border_title = "Stages"

    def show(self, event: SwarmEvent) -> None:
        self.swarm = event
        self.refresh(layout=True)

    def show_share(self, share: float | None) -> None:
        self.share = share
        self.refresh(layout=True)

    def show_sparta(self, tally: SpartaTally) -> None:
        self.tally = tally
        self.refresh(layout=True)

    def render(self) -> str:
        swarm = self.swarm
        if swarm is None or not swarm.stages:
            return "[$text-muted]waiting for the swarm's first report (from sync phase 1 on)[/]"
        rows = [_HEADER, *(stage_row(stage, stage.stage == swarm.stage) for stage in swarm.stages)]
        mine = next((stage for stage in swarm.stages if stage.stage == swarm.stage), None)
        stage = escape(swarm.stage or "your stage")
        share = f"[b]{self.share:.0%}[/]" if self.share is not None else "[$text-muted]not known yet[/]"
        workers = mine.active + mine.syncing if mine else 0
        fair = f" (fair share {1 / workers:.0%} of {workers})" if workers else ""
        rows += [
            "",
            f"swarm [b]{swarm.tokens_per_s:,.0f}[/] tokens/s · {swarm.trainers} trainer(s)",
            f"your share of {stage}: {share}{fair}",
            f"{stage} SPARTA: {sparta_health(self.tally, mine.active if mine else None)}",
            f"{stage} spot checks: {spot_text(mine.spot_checks if mine else None, full=True)}",
        ]
        return "\n".join(rows)
