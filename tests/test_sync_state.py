"""The join state machine's phases: their lengths in stage epochs, and phase 1 passed at once by fresh weights."""

from __future__ import annotations

from agora_client.config import SyncConfig, load_config
from agora_client.events import SyncEvent
from agora_client.swarm.launcher import SwarmOptions
from agora_client.worker.sync import SyncState


def _joiner(**config) -> tuple[SyncState, list[SyncEvent]]:
    events: list[SyncEvent] = []
    return SyncState(SyncConfig(phase1_steps=4, phase2_steps=2, **config), events.append, joining=True), events


def test_phases_count_stage_epochs_from_begin():
    sync, events = _joiner()
    assert sync.phase == 1 and sync.target_epoch is None
    sync.on_epoch(10, 10)  # before begin(): the clock has not started
    assert events == []
    sync.begin(10, weights_epoch=9)  # fresh weights, but the run does not skip phase 1
    assert (sync.phase, sync.target_epoch) == (1, 14)
    sync.on_epoch(13, 13)
    assert sync.phase == 1
    sync.on_epoch(14, 14)
    assert (sync.phase, sync.target_epoch, sync.averaging_weight) == (2, 16, 0.0)
    sync.on_epoch(16, 16)
    assert sync.phase == 0 and sync.averaging_weight == 1.0 and sync.counts_samples
    assert [e.phase for e in events] == ["sync1", "sync2", "active"]
    assert events[0].message.splitlines()[1] == "This phase will last 4 steps (until local epoch 14)."


def test_fresh_weights_pass_phase_1_at_once_where_the_run_says_so():
    sync, events = _joiner(skip_phase1_when_fresh=True, max_allowed_stale=5)
    sync.begin(20, weights_epoch=15)  # 5 epochs behind: as far as an active worker may trail
    assert [e.phase for e in events] == ["sync1", "sync2"]
    assert events[0].steps_total == 0 and "trail the stage by 5 epochs" in events[0].message
    # phase 2, the optimizer's warm-up, is as long as ever: receive-only, its samples not counted
    assert (sync.phase, sync.target_epoch, sync.averaging_weight, sync.counts_samples) == (2, 22, 0.0, False)
    sync.on_epoch(22, 22)
    assert sync.phase == 0


def test_stale_or_unknown_weights_pass_phase_1_in_full():
    for weights_epoch in (14, None):  # 6 epochs behind; an epoch not known
        sync, events = _joiner(skip_phase1_when_fresh=True, max_allowed_stale=5)
        sync.begin(20, weights_epoch=weights_epoch)
        assert (sync.phase, sync.target_epoch) == (1, 24)
        assert [e.phase for e in events] == ["sync1"]


def test_an_active_worker_that_falls_behind_syncs_again_in_full():
    events: list[SyncEvent] = []
    sync = SyncState(
        SyncConfig(phase1_steps=4, phase2_steps=2, skip_phase1_when_fresh=True), events.append, joining=False
    )
    sync.on_epoch(3, 9)  # 6 epochs behind its stage
    assert (sync.phase, sync.target_epoch) == (1, 13)
    assert [e.phase for e in events] == ["sync1"]


def test_tiny_joiners_usually_pass_phase_1_at_once():
    # what keeps the demo and bench/join_time.py fast: the local swarm publishes a snapshot every publish_every
    # stage epochs, so a joiner's snapshot trails its stage by about that much, well within max_allowed_stale
    sync = load_config("tiny").sync
    assert sync.skip_phase1_when_fresh
    assert SwarmOptions.publish_every < sync.max_allowed_stale
    assert not load_config("8b").sync.skip_phase1_when_fresh  # 8b's joiners pass phase 1 in full
