"""The auth service's series for operators: join decisions, queue lengths, slots per stage, trainer tickets.

Join decisions are the service's audit events (``AuthService.audit_totals``, one per line of ``joins.jsonl``); the
rest is the slot book's occupancy and its target workers per stage, as ``GET /v1/status`` reports them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agora_client.operator_metrics import Series, SeriesCollector, Values

from .admission import SlotBook

JOINS = Series(
    "agora_auth_joins",
    "counter",
    "join decisions by outcome (authorized, queued, rejected, unreachable, "
    "invalid_token, ...); a queued join admitted later counts once queued, once authorized",
    ("outcome",),
)
TRAINER_TICKETS = Series(
    "agora_auth_trainer_tickets", "counter", "trainer ticket requests, issued or refused", ("outcome",)
)
QUEUE_LENGTH = Series("agora_auth_queue_length", "gauge", "joiners waiting in the stage's queue", ("stage",))
SLOTS = Series(
    "agora_auth_slots",
    "gauge",
    "slots held on the stage: active, or pending (admitted, not yet active)",
    ("stage", "state"),
)
SLOT_CAPACITY = Series("agora_auth_slot_capacity", "gauge", "slots the stage has", ("stage",))
STAGE_TARGET = Series(
    "agora_auth_stage_target",
    "gauge",
    "workers the stage should have: from the plan's compute per stage, or the operator's --stage-target",
    ("stage",),
)
SERIES = (JOINS, TRAINER_TICKETS, QUEUE_LENGTH, SLOTS, SLOT_CAPACITY, STAGE_TARGET)

_TRAINER_EVENTS = {"trainer_ticket": "issued", "trainer_refused": "refused"}  # the audit's other events are joins'


def auth_collector(audit_totals: Callable[[], dict[str, int]], book: SlotBook) -> SeriesCollector:
    """``audit_totals``: the service's audit events so far, by event (``AuthService.audit_totals``)."""

    def read() -> dict[str, Values]:
        events = audit_totals()
        stages = book.occupancy(time.time())
        return {
            JOINS.name: {event: count for event, count in events.items() if event not in _TRAINER_EVENTS},
            TRAINER_TICKETS.name: {outcome: events.get(event, 0) for event, outcome in _TRAINER_EVENTS.items()},
            QUEUE_LENGTH.name: {stage: counts["queued"] for stage, counts in stages.items()},
            SLOTS.name: {
                (stage, state): counts[state] for stage, counts in stages.items() for state in ("active", "pending")
            },
            SLOT_CAPACITY.name: {stage: counts["capacity"] for stage, counts in stages.items()},
            STAGE_TARGET.name: {need.stage: need.target for need in book.policy.stage_demand.needs},
        }

    return SeriesCollector(SERIES, read)
