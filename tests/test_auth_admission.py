"""The slot book's rules with an explicit clock: pacing, integration, stale queue places, estimates."""

from __future__ import annotations

import pytest

from agora_client.auth.admission import AdmissionPolicy, Admitted, Queued, Rejected, SlotBook, UnknownQueueEntry


def book(**overrides) -> SlotBook:
    policy = {
        "stages": ("head", "tail"),
        "max_workers_per_stage": 3,
        "per_identity_cap": 5,
        "pacing_s": 10.0,
        "max_pending_per_stage": 1,
        "integration_timeout_s": 100.0,
        "queue_stale_s": 30.0,
        **overrides,
    }
    return SlotBook(AdmissionPolicy(**policy))


def test_pacing_queues_in_order_with_growing_estimates():
    slots = book(stages=("head",), max_pending_per_stage=5)
    assert isinstance(slots.join("a", "pa", now=0.0), Admitted)
    second, third = slots.join("b", "pb", now=1.0), slots.join("c", "pc", now=1.0)
    assert isinstance(second, Queued) and isinstance(third, Queued)
    assert (second.position, second.estimated_wait_s) == (1, 9.0)
    assert (third.position, third.estimated_wait_s) == (2, 19.0)
    assert isinstance(slots.poll(third.entry.queue_id, "pc", now=10.5), Queued)  # not its turn: b is first
    admitted = slots.poll(second.entry.queue_id, "pb", now=10.5)
    assert isinstance(admitted, Admitted) and admitted.waited_s == pytest.approx(9.5)
    assert slots.poll(third.entry.queue_id, "pc", now=11.0).position == 1
    with pytest.raises(UnknownQueueEntry):
        slots.poll(second.entry.queue_id, "pb", now=11.0)  # its place was turned into a slot


def test_pending_peer_blocks_until_active_or_integration_timeout():
    slots = book(stages=("head",), pacing_s=0.0)
    first = slots.join("a", "pa", now=0.0)
    waiting = slots.join("b", "pb", now=1.0)
    assert isinstance(waiting, Queued) and waiting.estimated_wait_s == 99.0
    for now in (25.0, 50.0, 75.0):
        assert isinstance(slots.poll(waiting.entry.queue_id, "pb", now=now), Queued)
    assert isinstance(slots.poll(waiting.entry.queue_id, "pb", now=100.0), Admitted)  # a's integration timed out
    third = slots.join("c", "pc", now=101.0)
    assert isinstance(third, Queued)
    assert slots.mark_active("head", 1, "pb", now=102.0)
    assert not slots.mark_active("head", 1, "someone-else", now=102.0)
    assert isinstance(slots.poll(third.entry.queue_id, "pc", now=102.0), Admitted)
    assert first.slot.index == 0


def test_stale_queue_places_are_dropped_and_the_next_moves_up():
    slots = book(stages=("head",), max_pending_per_stage=5, pacing_s=100.0)
    slots.join("a", "pa", now=0.0)
    gone = slots.join("b", "pb", now=1.0)
    kept = slots.join("c", "pc", now=1.0)
    assert slots.poll(kept.entry.queue_id, "pc", now=25.0).position == 2
    assert slots.poll(kept.entry.queue_id, "pc", now=32.0).position == 1  # b stopped polling at 1.0
    with pytest.raises(UnknownQueueEntry):
        slots.poll(gone.entry.queue_id, "pb", now=32.0)


def test_queue_places_count_against_capacity_and_identity_cap():
    slots = book(stages=("head",), max_workers_per_stage=2, per_identity_cap=2)
    slots.join("a", "pa", now=0.0)
    assert isinstance(slots.join("a", "pa2", now=0.0), Queued)
    capped = slots.join("a", "pa3", now=0.0)
    assert isinstance(capped, Rejected) and "a already runs 2 peers" in capped.reason
    full = slots.join("b", "pb", now=0.0)
    assert isinstance(full, Rejected) and "at capacity" in full.reason
    assert slots.occupancy(now=0.0)["head"] == {"active": 0, "pending": 1, "queued": 1, "capacity": 2}


def test_a_peer_id_belongs_to_one_identity():
    slots = book()
    slots.join("a", "shared", now=0.0)
    taken = slots.join("b", "shared", now=0.0)
    assert isinstance(taken, Rejected) and "another identity" in taken.reason


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        AdmissionPolicy(stages=())
    with pytest.raises(ValueError):
        AdmissionPolicy(stages=("head",), per_identity_cap=0)
