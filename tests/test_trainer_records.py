"""Trainers' records in the checkpoint store: a set takes each trainer's record nearest its time, retention prunes
them with the stages', ``agora checkpoints`` lists the eval loss, and a resume hands each trainer its position."""

from __future__ import annotations

import json

import pytest

from agora_client.checkpoints import CheckpointError, select_set
from agora_client.checkpoints.trainer_records import nearest_records, save_trainer_record
from agora_client.cli import main
from agora_client.config import load_config
from agora_client.snapshots import LocalStore
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from tests.test_checkpoints import T0, full_set

CONFIG = load_config("tiny")


def _record(store, shard: str, at: float, eval_loss: float | None, sequences: int) -> None:
    save_trainer_record(
        store,
        CONFIG,
        shard=shard,
        microbatches=sequences // 8,
        eval_loss=eval_loss,
        timestamp=at,
        position={"v": 1, "shard": shard, "sequences": sequences, "pass": 0},
    )


def test_trainer_records_a_set_takes_each_trainers_record_nearest_its_time(tmp_path):
    store = LocalStore(tmp_path / "store")
    full_set(store, T0)
    for shard in ("0/2", "1/2"):
        _record(store, shard, T0 - 300, 7.0, 80)
        _record(store, shard, T0 + 2, 6.0 if shard == "0/2" else 5.0, 160)
        _record(store, shard, T0 + 600, 4.0, 320)
    assert store.stages() == sorted(CONFIG.model.stage_names)  # the trainers' folder is not a stage
    chosen = select_set(store)
    assert {shard: record["position"]["sequences"] for shard, record in chosen.trainers.items()} == {
        "0/2": 160,
        "1/2": 160,
    }
    assert chosen.eval_loss == pytest.approx(5.5)
    assert nearest_records(store, T0 + 10_000)["0/2"]["eval_loss"] == 4.0


def test_trainer_records_follow_the_retention_policy(tmp_path):
    store = LocalStore(tmp_path / "store")
    day = 86400.0
    old = [T0 - 10 * day + minute * 60 for minute in range(5)]  # five records within one UTC day, ten days ago
    for at in [*old, T0 - 30, T0]:
        _record(store, "0/1", at, None, 8)
    _record(store, "1/2", old[0], None, 8)  # another trainer's records are not this one's to prune
    kept = store.record_names("trainers")
    assert kept == sorted(
        [f"0-of-1-{int(at * 1000)}.json" for at in (old[-1], T0 - 30, T0)] + [f"1-of-2-{int(old[0] * 1000)}.json"]
    )


def test_trainer_records_checkpoints_lists_the_eval_loss_per_set(tmp_path, capsys):
    store = LocalStore(tmp_path / "store")
    full_set(store, T0)
    _record(store, "0/1", T0 + 1, 3.25, 64)
    assert main(["checkpoints", "--store", str(tmp_path / "store"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert listed["eval_loss"] == 3.25 and listed["trainers"]["0/1"]["microbatches"] == 8
    assert main(["checkpoints", "--store", str(tmp_path / "store")]) == 0
    text = capsys.readouterr().out
    assert "eval 3.2500" in text and "trainer 0/1  data position at" in text


def test_trainer_records_a_resume_hands_each_trainer_its_record_and_checks_the_count(tmp_path):
    store = LocalStore(tmp_path / "store")
    full_set(store, T0)
    for shard in ("0/2", "1/2"):
        _record(store, shard, T0, 6.0, 96)
    options = SwarmOptions(trainers=2, run_dir=tmp_path / "run", checkpoint_store=str(tmp_path / "store"), resume=True)
    swarm = LocalSwarm(options)
    swarm.prepare_resume()
    assert set(swarm.resume_positions) == {"0/2", "1/2"}
    assert json.loads(swarm.resume_positions["1/2"].read_text())["position"]["shard"] == "1/2"
    options.trainers = 3
    with pytest.raises(CheckpointError, match="data positions are for 2 trainer.*--trainers 2"):
        LocalSwarm(options).prepare_resume()
