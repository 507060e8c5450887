"""The auth service's book of slots and join queues: who holds a slot, who waits, who is turned away.

Rules (issue 5, section 1):
- capacity: each stage has at most ``max_workers_per_stage`` slots; when no stage has room the join is
  rejected at once (there is no waiting list for a full swarm);
- one identity holds at most ``per_identity_cap`` slots or queue places;
- a joiner is given the stage that needs peers most among those its GPU holds: the fewest slots + queue places
  for the stage's target workers (``demand``, stage_demand.py: from the plan's compute per stage, or the operator's),
  ties to pipeline order;
- pacing: a stage admits again only ``pacing_s`` after its last admission and while fewer than
  ``max_pending_per_stage`` admitted peers have not yet reported active (for at most
  ``integration_timeout_s``); otherwise the joiner waits in that stage's FIFO queue, keeping its place
  as long as it polls at least every ``queue_stale_s``;
- a slot ends when its peer leaves, its ticket expires without renewal, or its peer is gone from the
  DHT for a few minutes (``observe``); a peer that re-joins while its slot is held (a restart after a
  crash) gets that same slot back at once.

Pure bookkeeping: no I/O, the caller passes ``now`` and holds no lock (this class has its own). A book
starts from a saved ``BookState`` and hands ``record`` a new one after every decision (state_store.py keeps it).
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from .stage_demand import StageDemand, even_demand


@dataclass(frozen=True)
class AdmissionPolicy:
    stages: tuple[str, ...]
    max_workers_per_stage: int = 8
    per_identity_cap: int = 2
    pacing_s: float = 30.0
    max_pending_per_stage: int = 1
    integration_timeout_s: float = 600.0
    ticket_ttl_s: float = 3600.0
    queue_stale_s: float = 120.0
    demand: StageDemand | None = None
    """Target workers per stage (stage_demand.py); None: every stage alike, the fewest workers first."""

    def __post_init__(self) -> None:
        if not self.stages or len(set(self.stages)) != len(self.stages):
            raise ValueError("the admission policy needs a list of distinct stage names")
        if self.demand is not None and self.demand.stages != tuple(self.stages):
            raise ValueError("the stage demand must name the policy's stages, in pipeline order")
        if self.max_workers_per_stage < 1 or self.per_identity_cap < 1 or self.max_pending_per_stage < 1:
            raise ValueError("max workers per stage, the per-identity cap and max pending per stage must be at least 1")
        if self.ticket_ttl_s <= 0 or self.queue_stale_s <= 0 or self.pacing_s < 0 or self.integration_timeout_s < 0:
            raise ValueError(
                "ticket TTL and queue staleness must be positive, pacing and integration timeout not negative"
            )

    @property
    def stage_demand(self) -> StageDemand:
        return self.demand or even_demand(self.stages, self.max_workers_per_stage)


@dataclass
class Slot:
    identity: str
    peer_id: str
    stage: str
    index: int
    admitted_at: float
    expires_at: float
    active: bool = False
    last_seen: float = 0.0  # last time the peer was seen in its stage's DHT roster (or admitted)

    def __post_init__(self) -> None:
        self.last_seen = self.last_seen or self.admitted_at


@dataclass
class QueueEntry:
    queue_id: str
    identity: str
    peer_id: str
    stage: str
    joined_at: float
    last_seen: float


@dataclass(frozen=True)
class Admitted:
    slot: Slot
    waited_s: float = 0.0


@dataclass(frozen=True)
class Queued:
    entry: QueueEntry
    position: int
    estimated_wait_s: float


@dataclass(frozen=True)
class Rejected:
    reason: str


Decision = Admitted | Queued | Rejected


@dataclass(frozen=True)
class BookState:
    """A copy of everything a book decides from: what a store saves, and what a restarted book starts from."""

    slots: tuple[Slot, ...] = ()
    queue: tuple[QueueEntry, ...] = ()
    """Every waiting place; the places of one stage in their queue order."""
    last_admissions: dict[str, float] = field(default_factory=dict)


class UnknownQueueEntry(LookupError):
    """A poll for a queue place that does not exist (stale, or already admitted)."""


@dataclass
class _Stage:
    slots: dict[int, Slot] = field(default_factory=dict)
    queue: deque[QueueEntry] = field(default_factory=deque)
    last_admission: float | None = None


class SlotBook:
    """``saved``: the state to start from (slots and places of stages the policy lacks are left out).
    ``record``: called, under the book's lock, with the state after every decision that may change it; the caller
    gets a decision only once ``record`` returned, so a store that commits there loses no answer given.
    """

    def __init__(
        self,
        policy: AdmissionPolicy,
        saved: BookState | None = None,
        record: Callable[[BookState], None] | None = None,
    ):
        self.policy = policy
        self._stages = {name: _Stage() for name in policy.stages}
        self._lock = threading.Lock()
        self._record = record
        if saved is not None:
            self._load(saved)

    # -- joining -------------------------------------------------------------------------------------

    def join(self, identity: str, peer_id: str, now: float, stages: Collection[str] | None = None) -> Decision:
        """``stages``: the only stages a new slot may be on (those the joiner's GPU holds); None for any."""
        with self._lock:
            decision = self._join(identity, peer_id, now, stages)
            self._recorded()
            return decision

    def poll(self, queue_id: str, peer_id: str, now: float) -> Decision:
        with self._lock:
            self._expire(now)
            entry = self._find_entry(lambda item: item.queue_id == queue_id)
            if entry is None or entry.peer_id != peer_id:
                raise UnknownQueueEntry(queue_id)
            decision = self._poll_entry(entry, now)
            self._recorded()
            return decision

    # -- holding a slot ------------------------------------------------------------------------------

    def leave(self, stage: str, index: int, peer_id: str, now: float) -> bool:
        with self._lock:
            self._expire(now)
            slot = self._slot(stage, index, peer_id)
            if slot is not None:
                del self._stages[stage].slots[index]
            self._recorded()
            return slot is not None

    def mark_active(self, stage: str, index: int, peer_id: str, now: float) -> bool:
        with self._lock:
            self._expire(now)
            slot = self._slot(stage, index, peer_id)
            if slot is not None:
                slot.active = True
            self._recorded()
            return slot is not None

    def renew(self, stage: str, index: int, peer_id: str, now: float) -> Slot | None:
        with self._lock:
            self._expire(now)
            slot = self._slot(stage, index, peer_id)
            if slot is not None:
                slot.expires_at = now + self.policy.ticket_ttl_s
            self._recorded()
            return slot

    def observe(self, present: dict[str, set[str]], now: float, vanish_s: float) -> list[Slot]:
        """Record which peers the DHT shows per stage; free and return the slots of peers gone ``vanish_s``.

        A slot still integrating (admitted, not yet active, within the integration timeout) is never freed
        here: its peer may still be downloading and not be in the DHT yet.
        """
        freed = []
        with self._lock:
            self._expire(now)
            for name, stage in self._stages.items():
                seen = present.get(name, set())
                for index, slot in list(stage.slots.items()):
                    if slot.peer_id in seen:
                        slot.last_seen = now
                    elif not self._is_pending(slot, now) and now - slot.last_seen >= vanish_s:
                        del stage.slots[index]
                        freed.append(slot)
            self._recorded()
        return freed

    def next_stage(self, now: float) -> str | None:
        """The stage a joiner that can hold any stage would be given now (None: the swarm is full)."""
        with self._lock:
            self._expire(now)
            return self._neediest_stage(None)

    def occupancy(self, now: float) -> dict[str, dict[str, int]]:
        with self._lock:
            self._expire(now)
            return {
                name: {
                    "active": sum(slot.active for slot in stage.slots.values()),
                    "pending": sum(not slot.active for slot in stage.slots.values()),
                    "queued": len(stage.queue),
                    "capacity": self.policy.max_workers_per_stage,
                }
                for name, stage in self._stages.items()
            }

    # -- internals (lock held) -----------------------------------------------------------------------

    def _load(self, saved: BookState) -> None:
        for slot in saved.slots:
            if slot.stage in self._stages:
                self._stages[slot.stage].slots[slot.index] = replace(slot)
        for entry in saved.queue:
            if entry.stage in self._stages:
                self._stages[entry.stage].queue.append(replace(entry))
        for name, at in saved.last_admissions.items():
            if name in self._stages:
                self._stages[name].last_admission = at

    def _state(self) -> BookState:
        stages = self._stages.values()
        return BookState(
            slots=tuple(replace(slot) for stage in stages for slot in stage.slots.values()),
            queue=tuple(replace(entry) for stage in stages for entry in stage.queue),
            last_admissions={
                name: stage.last_admission for name, stage in self._stages.items() if stage.last_admission is not None
            },
        )

    def _recorded(self) -> None:
        if self._record is not None:
            self._record(self._state())

    def _join(self, identity: str, peer_id: str, now: float, stages: Collection[str] | None) -> Decision:
        self._expire(now)
        queued = self._find_entry(lambda entry: entry.peer_id == peer_id)
        if queued is not None:
            if queued.identity != identity:
                return Rejected(
                    f"peer id {peer_id} is already waiting under another identity; start with a new peer id"
                )
            return self._poll_entry(queued, now)  # a re-join keeps its place
        held = self._find_slot(lambda slot: slot.peer_id == peer_id)
        if held is not None:
            if held.identity != identity:
                return Rejected(
                    f"peer id {peer_id} already holds a slot under another identity; start with a new peer id"
                )
            # The peer restarted (a crash leaves its slot held): it gets the same slot back at once,
            # without pacing, and syncs in again like any joiner.
            held.admitted_at = held.last_seen = now
            held.expires_at = now + self.policy.ticket_ttl_s
            held.active = False
            return Admitted(held)
        taken = self._count_identity(identity)
        if taken >= self.policy.per_identity_cap:
            return Rejected(
                f"{identity} already runs {taken} peers, the most one contributor may run at once "
                f"({self.policy.per_identity_cap}); stop one of them, or wait until its slot expires"
            )
        stage = self._neediest_stage(stages)
        if stage is None and stages is not None and len(stages) < len(self._stages):
            return Rejected(f"every stage your GPU can hold ({', '.join(stages)}) is full; try again later")
        if stage is None:
            total = self.policy.max_workers_per_stage * len(self._stages)
            return Rejected(f"the swarm is at capacity (all {total} worker slots are taken); try again later")
        if not self._stages[stage].queue and self._can_admit(stage, now):
            return Admitted(self._admit(identity, peer_id, stage, now))
        entry = QueueEntry(secrets.token_urlsafe(16), identity, peer_id, stage, now, now)
        self._stages[stage].queue.append(entry)
        return self._queued(entry, now)

    def _poll_entry(self, entry: QueueEntry, now: float) -> Decision:
        entry.last_seen = now
        queue = self._stages[entry.stage].queue
        if queue[0] is entry and self._can_admit(entry.stage, now):
            queue.popleft()
            return Admitted(
                self._admit(entry.identity, entry.peer_id, entry.stage, now), waited_s=now - entry.joined_at
            )
        return self._queued(entry, now)

    def _queued(self, entry: QueueEntry, now: float) -> Queued:
        position = list(self._stages[entry.stage].queue).index(entry) + 1
        wait = self._wait_for_turn(entry.stage, now) + (position - 1) * self.policy.pacing_s
        return Queued(entry, position, round(wait, 1))

    def _wait_for_turn(self, stage: str, now: float) -> float:
        """Seconds until the stage may admit again, if nothing else changes."""
        book = self._stages[stage]
        wait = 0.0
        if book.last_admission is not None:
            wait = book.last_admission + self.policy.pacing_s - now
        pending = sorted(slot.admitted_at for slot in book.slots.values() if self._is_pending(slot, now))
        excess = len(pending) - self.policy.max_pending_per_stage
        if excess >= 0:
            wait = max(wait, pending[excess] + self.policy.integration_timeout_s - now)
        return max(0.0, wait)

    def _can_admit(self, stage: str, now: float) -> bool:
        book = self._stages[stage]
        if book.last_admission is not None and now - book.last_admission < self.policy.pacing_s:
            return False
        pending = sum(self._is_pending(slot, now) for slot in book.slots.values())
        return pending < self.policy.max_pending_per_stage

    def _is_pending(self, slot: Slot, now: float) -> bool:
        return not slot.active and now - slot.admitted_at < self.policy.integration_timeout_s

    def _admit(self, identity: str, peer_id: str, stage: str, now: float) -> Slot:
        book = self._stages[stage]
        index = next(i for i in range(self.policy.max_workers_per_stage + 1) if i not in book.slots)
        slot = Slot(identity, peer_id, stage, index, now, now + self.policy.ticket_ttl_s)
        book.slots[index] = slot
        book.last_admission = now
        return slot

    def _neediest_stage(self, allowed: Collection[str] | None) -> str | None:
        loads = {name: len(stage.slots) + len(stage.queue) for name, stage in self._stages.items()}
        open_stages = [
            name
            for name in self.policy.stages
            if loads[name] < self.policy.max_workers_per_stage and (allowed is None or name in allowed)
        ]
        demand = self.policy.stage_demand
        # min() keeps the first of equal fills: ties go to pipeline order.
        return min(open_stages, key=lambda name: demand.fill(name, loads[name])) if open_stages else None

    def _expire(self, now: float) -> None:
        for stage in self._stages.values():
            for index in [index for index, slot in stage.slots.items() if slot.expires_at <= now]:
                del stage.slots[index]
            stage.queue = deque(entry for entry in stage.queue if now - entry.last_seen < self.policy.queue_stale_s)

    def _count_identity(self, identity: str) -> int:
        return sum(
            sum(slot.identity == identity for slot in stage.slots.values())
            + sum(entry.identity == identity for entry in stage.queue)
            for stage in self._stages.values()
        )

    def _find_entry(self, matches) -> QueueEntry | None:
        return next((entry for stage in self._stages.values() for entry in stage.queue if matches(entry)), None)

    def _find_slot(self, matches) -> Slot | None:
        return next((slot for stage in self._stages.values() for slot in stage.slots.values() if matches(slot)), None)

    def _slot(self, stage: str, index: int, peer_id: str) -> Slot | None:
        book = self._stages.get(stage)
        slot = book.slots.get(index) if book is not None else None
        return slot if slot is not None and slot.peer_id == peer_id else None
