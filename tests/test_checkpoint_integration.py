"""A real tiny swarm checkpoints by timestamp; stopped, it resumes where it was, and its export is the model.

One trained swarm serves every test: it trains until the loss has clearly fallen (by a nat, while every stage
steps at least 3 times), then stops (each stage writes a final checkpoint). The export of its newest set must give the
same logits as its stages run in sequence; its trainer's record in the set holds its data position and eval loss; a
second swarm resumed from the set must start near the last loss, far below the loss of a fresh start, with its trainer's
data continuing from the recorded position.
"""

from __future__ import annotations

import json

import pytest

from agora_client.checkpoints import select_set
from agora_client.cli import main
from agora_client.snapshots import open_store
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from tests.swarm_helpers import events, progress, tiny_variant, wait_until
from tests.test_checkpoints import assert_export_matches_stages

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
CHECKPOINT_PERIOD_S = 3.0
LOSS_DROP = 1.0  # nats the first swarm must learn before it is stopped
EVAL_EVERY_S = 10.0  # the newest eval loss is one taken well into training


def _trainer_losses(swarm: LocalSwarm, *, running: bool = True) -> list[float]:
    trainer = swarm.trainers[0]
    assert trainer.alive or not running, f"the trainer exited; see {trainer.log_path}"
    return [loss for done, loss in progress(trainer.lines()) if done > 0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("checkpoints")
    preset_path = tiny_variant(
        run_dir / "tiny-checkpoints.yaml",
        {"checkpoint": {"period_s": CHECKPOINT_PERIOD_S}, "eval": {"every_s": EVAL_EVERY_S}},
    )
    store = str(run_dir / "checkpoints")
    swarm = LocalSwarm(
        SwarmOptions(
            preset=preset_path, workers_per_stage=1, run_dir=run_dir / "first", report_every=3.0, checkpoint_store=store
        )
    )

    def trained_enough() -> bool:  # every stage steps on its own epoch boundary: each must have stepped 3 times
        losses = _trainer_losses(swarm)
        return len(losses) >= 3 and losses[0] - losses[-1] >= LOSS_DROP and min(_stage_epochs(swarm).values()) >= 3

    try:
        swarm.start()
        wait_until(
            trained_enough, timeout=500, what=f"the loss to fall by {LOSS_DROP} nat while every stage steps 3 times"
        )
    finally:
        swarm.stop()
    losses = _trainer_losses(swarm, running=False)
    return {
        "preset": preset_path,
        "store": store,
        "run_dir": run_dir,
        "fresh": losses[0],
        "last": losses[-1],
        "losses": losses,
        "stage_epochs": _stage_epochs(swarm),
    }


def _stage_epochs(swarm: LocalSwarm) -> dict[str, int]:
    """The local epoch each stage's worker last stepped to, from its events."""
    return {
        stage: max(
            (
                event["local_epoch"]
                for event in events(swarm.options.run_dir / "events" / f"{stage}-0.jsonl")
                if event["kind"] == "step"
            ),
            default=0,
        )
        for stage in swarm.config.model.stage_names
    }


def test_the_loss_fell_by_a_nat_while_every_stage_stepped(trained):
    assert min(trained["stage_epochs"].values()) >= 3
    assert trained["fresh"] - min(trained["losses"][-2:]) >= LOSS_DROP, trained["losses"]


def test_every_stage_checkpointed_by_time_and_the_set_records_the_loss(trained, capsys):
    store = open_store(trained["store"])
    assert all(len(store.list(stage)) >= 2 for stage in ("head", "body1", "body2", "tail"))
    newest = select_set(store)
    assert not newest.missing and newest.loss is not None
    assert abs(newest.loss - trained["last"]) < 1.0  # the tail's loss is the one the trainer reported
    assert main(["checkpoints", "--store", trained["store"], "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(listed) >= 2 and all(set(entry["stages"]) == {"head", "body1", "body2", "tail"} for entry in listed)


def test_export_equals_the_swarm(trained, tmp_path):
    store = open_store(trained["store"])
    assert_export_matches_stages(store, select_set(store), tmp_path / "hf", tmp_path / "cache")


def test_the_trainer_recorded_its_data_position_and_eval_loss_with_the_checkpoints(trained):
    chosen = select_set(open_store(trained["store"]))
    record = chosen.trainers["0/1"]
    assert record["position"]["sequences"] == record["microbatches"] * 8  # just after the microbatches handed out
    assert chosen.eval_loss is not None and chosen.eval_loss < trained["fresh"]


def test_a_stopped_swarm_resumes_near_its_last_loss_and_continues_its_data(trained):
    position = select_set(open_store(trained["store"])).trainers["0/1"]["position"]
    swarm = LocalSwarm(
        SwarmOptions(
            preset=trained["preset"],
            workers_per_stage=1,
            run_dir=trained["run_dir"] / "resumed",
            report_every=3.0,
            checkpoint_store=trained["store"],
            resume=True,
        )
    )
    try:
        swarm.start()
        wait_until(lambda: len(_trainer_losses(swarm)) >= 2, timeout=300, what="two loss reports after the resume")
        resumed = _trainer_losses(swarm)[:2]
    finally:
        swarm.stop()
    restored = [
        event
        for event in events(trained["run_dir"] / "resumed" / "events" / "tail-0.jsonl")
        if event["kind"] == "log" and "restored tail" in event["message"]
    ]
    assert restored, "the tail worker did not start from its checkpoint"
    resumed_at = f"resumed at pass {position['pass']}, sequence {position['sequences']}"
    assert any(line.startswith("[DATA]") and resumed_at in line for line in swarm.trainers[0].lines()), resumed_at
    fresh, last = trained["fresh"], trained["last"]
    assert max(resumed) <= last + 0.5, (resumed, last)
    assert max(resumed) <= fresh - 0.75 * LOSS_DROP, (resumed, fresh)
