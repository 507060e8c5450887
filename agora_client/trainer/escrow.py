"""Escrow: compute served on a stage that spot checks cannot judge yet waits until a check vouches for it.

A stage and kind of request that is ``calibrating`` (a two-worker stage never leaves that state) or
``unverifiable`` strikes no one (agora_client/trainer/calibration.py), so a worker answering random tensors there
would be paid in full. Instead, the FLOPs a worker serves there go into its open *window* (per stage, kind and
worker), and every spot check it answers there is kept in that window: who answered and how far apart the answers
were. A window closes once it is ``escrow_window_s`` old and holds at least one check (a worker cannot tell a check
from any other request, so each window is sampled). Once its stage and kind is verifiable (a later calibration:
the tolerance comes from these same checks' honest distances), each closed window is judged by its checks:

- the worker's answer agreed with another one (within the tolerance) on every check: *released*, paid;
- on some check it stood beyond the strike distance from a reference worker's answer (an operator-run worker
  whose answers are trusted: ``reference_workers``), or from two answers that agreed: *caught*, never paid;
- otherwise (it disagreed and nobody can be blamed, as with two answers and no referee): *disputed*, and every
  worker of that check pays for it: the window pays neither side.

A window that nothing judged within ``escrow_hold_s`` of its opening *expires* unpaid: on a two-worker stage
without a reference worker, or one that stays unverifiable; so does what the escrow holds when the trainer stops.
A reference worker's own work is never held. The receipt carries, per worker, the FLOPs held now, the FLOPs
forfeited and the disputed windows; the monitor pays the rest (monitor/store.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from agora_client.config import SpotCheckConfig
from agora_client.discovery.progress_records import CheckStanding
from agora_client.trainer.calibration import strike_distance

SETTLE_EVERY_S = 1.0  # requests and checks settle the windows at most this often: the pipeline's threads wait on it
Outcome = Literal["agrees", "caught", "disputed"]
Key = tuple[str, str, str]  # stage, kind, worker peer id


@dataclass(frozen=True)
class Witnessed:
    """One spot check's answers: the workers that answered it and each pair's relative distance."""

    peers: tuple[str, ...]
    distances: dict[tuple[int, int], float]  # (i, j) with i < j, indices into peers

    def distance(self, i: int, j: int) -> float:
        return self.distances[min(i, j), max(i, j)]

    def outcome(self, peer: str, tolerance: float, strike_at: float, references: frozenset[str]) -> Outcome:
        """What this check says of ``peer``'s answer, judged with a tolerance calibrated since."""
        mine = self.peers.index(peer)
        others = [j for j in range(len(self.peers)) if j != mine]
        if any(self.distance(mine, j) <= tolerance for j in others):
            return "agrees"
        trusted = [j for j in others if self.peers[j] in references]
        if trusted:
            return "caught" if self.distance(mine, trusted[0]) > strike_at else "disputed"
        if len(others) == 2 and self.distance(*others) <= tolerance:
            return "caught" if min(self.distance(mine, j) for j in others) > strike_at else "disputed"
        return "disputed"


@dataclass
class _Window:
    opened_at: float
    flops: float = 0.0
    checks: list[Witnessed] = field(default_factory=list)


@dataclass
class Tally:
    """One worker's escrow: what is held now, what was released, what it lost and how many windows were disputed."""

    held_flops: float = 0.0
    released_flops: float = 0.0
    forfeited_flops: float = 0.0  # caught, disputed or expired
    disputed_windows: int = 0


class Escrow:
    """The trainer's escrow of unjudged work; thread-safe (the pipeline's threads and the receipts thread use it)."""

    def __init__(self, config: SpotCheckConfig, clock: Callable[[], float] = time.monotonic):
        self.config, self.clock = config, clock
        self.references = frozenset(config.reference_workers)
        self._lock = threading.Lock()
        self._standings: dict[tuple[str, str], CheckStanding] = {}
        self._open: dict[Key, _Window] = {}
        self._closed: list[tuple[Key, _Window]] = []
        self._tallies: dict[str, Tally] = {}
        self._settled_at = -SETTLE_EVERY_S
        self._longest_release_s: float | None = None  # from a released window's opening to its release

    def judged(self, stage: str, kind: str) -> bool:
        with self._lock:
            standing = self._standings.get((stage, kind))
        return standing is not None and standing.state == "verifiable"

    def stand(self, stage: str, kind: str, standing: CheckStanding) -> None:
        """The stage and kind's standing changed (or its tolerance did): closed windows may now be judged."""
        with self._lock:
            self._standings[stage, kind] = standing
            self._settle(self.clock())

    def receive(self, stage: str, kind: str, peer: str, flops: float) -> None:
        """``peer`` served ``flops`` of ``kind`` on ``stage``: held unless judged there or a reference worker."""
        if peer in self.references or self.judged(stage, kind):
            return
        with self._lock:
            now = self.clock()
            self._settle(now, when_due=True)  # a window that is due closes before it takes more
            window = self._open.setdefault((stage, kind, peer), _Window(opened_at=now))
            window.flops += flops
            self._tally(peer).held_flops += flops

    def holding(self, stage: str, kind: str, peers: list[str]) -> bool:
        """Whether one of ``peers`` has an open window on ``stage`` and ``kind``: a check on them is evidence."""
        with self._lock:
            return any((stage, kind, peer) in self._open for peer in peers)

    def witness(self, stage: str, kind: str, check: Witnessed) -> None:
        """A spot check on an unjudged stage: evidence for each answering worker's open window."""
        with self._lock:
            for peer in check.peers:
                window = self._open.get((stage, kind, peer))
                if window is not None:
                    window.checks.append(check)
            self._settle(self.clock(), when_due=True)

    def tally(self, peer: str) -> Tally:
        """A copy of ``peer``'s escrow, windows due for judging or expiry settled first."""
        with self._lock:
            self._settle(self.clock(), when_due=True)
            return Tally(**vars(self._tally(peer)))

    def close(self) -> None:
        """The trainer stops: no check of its can vouch for what it still holds, which is forfeited."""
        with self._lock:
            windows = [*self._closed, *self._open.items()]
            self._closed, self._open = [], {}
            for (_, _, peer), window in windows:
                self._forfeit(peer, window, disputed=False)

    @property
    def longest_release_s(self) -> float | None:
        """The longest any released compute waited; None before a release."""
        with self._lock:
            return self._longest_release_s

    def _tally(self, peer: str) -> Tally:
        return self._tallies.setdefault(peer, Tally())

    def _settle(self, now: float, *, when_due: bool = False) -> None:
        """Close the windows that are due, judge the closed ones their stage can judge, expire the old ones
        (``when_due``: unless it was done less than SETTLE_EVERY_S ago)."""
        if when_due and now - self._settled_at < SETTLE_EVERY_S:
            return
        self._settled_at = now
        for key, window in list(self._open.items()):
            if now - window.opened_at >= self.config.escrow_window_s and window.checks:
                self._closed.append((key, self._open.pop(key)))
            elif now - window.opened_at >= self.config.escrow_hold_s:
                self._forfeit(key[2], self._open.pop(key), disputed=False)
        waiting = []
        for key, window in self._closed:
            standing = self._standings.get(key[:2])
            if standing is not None and standing.state == "verifiable" and standing.tolerance is not None:
                self._judge(key[2], window, standing.tolerance, now)
            elif now - window.opened_at >= self.config.escrow_hold_s:
                self._forfeit(key[2], window, disputed=False)
            else:
                waiting.append((key, window))
        self._closed = waiting

    def _judge(self, peer: str, window: _Window, tolerance: float, now: float) -> None:
        strike_at = strike_distance(tolerance, self.config.margin)
        outcomes = {check.outcome(peer, tolerance, strike_at, self.references) for check in window.checks}
        if outcomes == {"agrees"}:
            tally = self._tally(peer)
            tally.held_flops -= window.flops
            tally.released_flops += window.flops
            self._longest_release_s = max(self._longest_release_s or 0.0, now - window.opened_at)
        else:
            self._forfeit(peer, window, disputed="caught" not in outcomes)

    def _forfeit(self, peer: str, window: _Window, *, disputed: bool) -> None:
        tally = self._tally(peer)
        tally.held_flops -= window.flops
        tally.forfeited_flops += window.flops
        tally.disputed_windows += disputed
