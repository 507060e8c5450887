"""Reading a trainer's [PROGRESS] and [EVAL] lines as they arrive, for the bench scripts that run a local swarm."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

PROGRESS = re.compile(r"\[PROGRESS\] microbatches=(\d+) loss=([0-9.]+|n/a)")
EVAL = re.compile(r"\[EVAL\] loss=([0-9.]+) ")
STAGE = re.compile(r"(\w+): \d+/\d+ ready, .*? served \[([^\]]*)\]")


@dataclass
class ProgressPoint:
    at: float  # time.monotonic() when the line was read
    microbatches: int  # done since the trainer started
    loss: float | None  # None when no microbatch finished in the window
    served: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> uid -> requests in this window


@dataclass(frozen=True)
class EvalPoint:
    at: float  # time.monotonic() when the line was read
    loss: float  # on the trainer's held-out sample
    microbatches: int  # done at the trainer's preceding [PROGRESS] line (0 before the first): within report_every s


def parse(line: str, at: float) -> ProgressPoint | None:
    match = PROGRESS.search(line)
    if match is None:
        return None
    served = {
        stage: {uid: int(n) for uid, _, n in (item.partition("=") for item in items.split())}
        for stage, items in STAGE.findall(line.split("|", 1)[-1])
    }
    loss = None if match.group(2) == "n/a" else float(match.group(2))
    return ProgressPoint(at, int(match.group(1)), loss, served)


class ProgressRecorder:
    """An ``on_line`` callback for LocalSwarm.

    Keeps every trainer's progress and evaluation points, stamped on arrival."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.points: dict[str, list[ProgressPoint]] = {}
        self.evaluations: dict[str, list[EvalPoint]] = {}

    def __call__(self, name: str, line: str) -> None:
        at = time.monotonic()
        point = parse(line, at)
        evaluation = EVAL.search(line)
        with self._lock:
            if point is not None:
                self.points.setdefault(name, []).append(point)
            elif evaluation is not None:  # one process's lines arrive in order: its last point precedes this line
                done = self.points[name][-1].microbatches if self.points.get(name) else 0
                self.evaluations.setdefault(name, []).append(EvalPoint(at, float(evaluation.group(1)), done))

    def of(self, name: str) -> list[ProgressPoint]:
        with self._lock:
            return list(self.points.get(name, []))

    def evaluations_of(self, name: str) -> list[EvalPoint]:
        with self._lock:
            return list(self.evaluations.get(name, []))


def microbatches_per_second(points: list[ProgressPoint]) -> float:
    """Microbatches finished between the first and the last point, per second."""
    if len(points) < 2 or points[-1].at <= points[0].at:
        return 0.0
    return (points[-1].microbatches - points[0].microbatches) / (points[-1].at - points[0].at)


def tokens_per_second(points: list[ProgressPoint], tokens_per_microbatch: int) -> float:
    """Microbatches finished between the first and the last point, in tokens per second."""
    return microbatches_per_second(points) * tokens_per_microbatch


def served_by(points: list[ProgressPoint], stage: str) -> dict[str, int]:
    """Requests each worker of a stage served over these points (the first point's window is not counted)."""
    total: dict[str, int] = {}
    for point in points[1:]:
        for uid, count in point.served.get(stage, {}).items():
            total[uid] = total.get(uid, 0) + count
    return total
