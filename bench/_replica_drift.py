"""How far a local swarm's replicas of each stage drift apart, read from its workers' SPARTA events.

A LocalSwarm worker writes its events to ``<run_dir>/events/<stage>-<index>.jsonl``; every SPARTA round that
averaged carries ``drift_before`` / ``drift_after``: the relative L2 of that worker's slice from its group's
average before and right after the update (agora_client/averaging/drift.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agora_client.events import json_objects


@dataclass(frozen=True)
class RoundSeen:
    """One worker's SPARTA event."""

    worker: str
    ts: float  # wall clock
    ok: bool
    bytes_sent: int
    drift_before: float | None
    drift_after: float | None


def rounds_by_stage(events_dir: Path) -> dict[str, list[RoundSeen]]:
    """Every SPARTA event of every worker (killed ones and joiners included), by stage, oldest first."""
    found: dict[str, list[RoundSeen]] = {}
    for path in sorted(events_dir.glob("*-*.jsonl")):
        worker, stage = path.stem, path.stem.rsplit("-", 1)[0]
        for event in json_objects(path.read_text(encoding="utf-8").splitlines()):
            if event.get("kind") == "sparta":
                found.setdefault(stage, []).append(
                    RoundSeen(
                        worker,
                        event["ts"],
                        bool(event.get("ok")),
                        int(event.get("bytes_sent", 0)),
                        event.get("drift_before"),
                        event.get("drift_after"),
                    )
                )
    return {stage: sorted(rounds, key=lambda seen: seen.ts) for stage, rounds in found.items()}


def drift_between(rounds: list[RoundSeen], since: float, until: float) -> dict:
    """The mean and largest drift the stage's workers reported in (since, until] (wall clock), before and after."""
    measured = [
        seen
        for seen in rounds
        if since < seen.ts <= until and seen.drift_before is not None and seen.drift_after is not None
    ]
    if not measured:
        return {"rounds": 0, "before_mean": None, "before_max": None, "after_mean": None}
    before = [seen.drift_before for seen in measured]
    return {
        "rounds": len(measured),
        "before_mean": round(sum(before) / len(before), 5),
        "before_max": round(max(before), 5),
        "after_mean": round(sum(seen.drift_after for seen in measured) / len(measured), 6),
    }


def sparta_tally(rounds: list[RoundSeen]) -> dict:
    """A stage's SPARTA rounds over the run.

    Reported (every worker counts its own), averaged, bytes each worker sent."""
    workers = {seen.worker for seen in rounds}
    return {
        "rounds_reported": len(rounds),
        "rounds_averaged": sum(seen.ok for seen in rounds),
        "bytes_sent_per_worker": round(sum(seen.bytes_sent for seen in rounds) / max(1, len(workers))),
    }
