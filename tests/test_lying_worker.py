"""A lying worker in a real local swarm is caught by the trainer's spot checks, banned, loses its points,
and training goes on: the loss still falls.

The liar joins like any contributor (auth service, snapshot, sync phases), run by tests/faulty_worker.py
with `--lie`: it computes, then answers random tensors of the right shape and scale. Placeholder admissions
hold the auth service's head and body slots, so the liar lands in the tail, which has two honest workers:
every disagreement has a referee. (Honest head replicas of this preset drift nearly as far apart as random
outputs, so the head's calibrated tolerance may leave it unverifiable; see agora_client/trainer/calibration.py.)
"""

from __future__ import annotations

from importlib import resources

import httpx
import pytest
import yaml
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth.client import authorize
from agora_client.auth.identity import write_demo_token_file
from agora_client.auth.key_proof import peer_id_of_public_key
from agora_client.events import EventWriter, json_objects
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from agora_client.swarm.processes import ManagedProcess
from tests.faulty_worker import faulty
from tests.swarm_helpers import progress, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
# check often and judge soon, and release escrow in short windows: the test is short
SPOT_CHECKS = {"fraction": 0.5, "strikes": 3, "min_samples": 10, "escrow_window_s": 5.0}


def test_a_lying_worker_is_banned_loses_its_points_and_the_loss_still_falls(tmp_path):
    preset = yaml.safe_load((resources.files("agora_client") / "presets" / "tiny.yaml").read_text())
    preset["spot_checks"] = SPOT_CHECKS
    # the liar serves after a full phase 1, as it did before tiny skipped it: the tail calibrates on honest answers
    # first (a liar while a stage calibrates is paid nothing, test_gaming_escrow.py, but its answers train)
    preset["sync"]["skip_phase1_when_fresh"] = False
    preset_path = tmp_path / "spot.yaml"
    preset_path.write_text(yaml.safe_dump(preset))
    swarm = LocalSwarm(
        SwarmOptions(
            preset=str(preset_path),
            workers_per_stage=1,
            trainers=0,
            run_dir=tmp_path / "run",
            publish_snapshots=True,
            report_every=3,
        )
    )
    liar = None
    try:
        swarm.start()
        swarm.start_worker("tail")  # the liar's stage: two honest workers referee each other's disagreements
        fillers = [write_demo_token_file(tmp_path / "run" / "auth" / "tokens.json", f"filler{i}") for i in range(2)]
        auth_url, token = swarm.start_join_services(pacing=1.0, auth_args=("--no-dial-back",))  # fillers open no port
        for filler in (fillers[0], fillers[0], fillers[1]):  # admitted, never active: head, body1, body2 are taken
            key = RSAPrivateKey()
            authorize(
                auth_url,
                filler,
                peer_id_of_public_key(key.get_public_key().to_bytes()),
                events=EventWriter(),
                peer_key=key,
            )
        monitor_url = swarm.start_monitor(auth_url, interval=2.0)
        trainer = swarm.start_trainer()  # the launcher gives it the auth service's key: it can name the liar
        liar = ManagedProcess(
            "liar",
            ["runtime", "--cpu", "--swarm", auth_url, "--config-dir", str(tmp_path / "liar"), "--host-port", "0"],
            tmp_path / "liar.log",
            env={"HF_TOKEN": token},
            program=faulty(lie=True),
        )
        wait_until(
            lambda: any(e["kind"] == "stage" for e in json_objects(liar.lines())), 240, "the liar's worker to start"
        )
        stage_event = next(e for e in json_objects(liar.lines()) if e["kind"] == "stage")
        assert stage_event["stage"] == "tail"
        liar_id = stage_event["peer_id"]

        wait_until(
            lambda: any("[SPOTCHECK] banned" in line and liar_id in line for line in trainer.lines()),
            400,
            "the trainer to ban the liar",
        )
        banned = [line for line in trainer.lines() if "[SPOTCHECK] banned" in line]
        assert len(banned) == 1, banned  # the liar, and no honest worker

        def liar_points() -> dict:
            reply = httpx.get(f"{monitor_url}/peers/{liar_id}", timeout=5)
            return reply.json() if reply.status_code == 200 else {}

        # Its metrics claim the work it did; the monitor credits none of it.
        wait_until(
            lambda: liar_points().get("withheld_compute", 0) > 0, 120, "the monitor to withhold the liar's compute"
        )
        points = liar_points()
        assert points["withheld"] and points["compute"] == 0.0
        # What it served while the tail calibrated waited in the trainer's escrow and is forfeited, for all to see.
        wait_until(
            lambda: httpx.get(f"{monitor_url}/swarm", timeout=5).json()["escrow"]["forfeited"] > 0,
            120,
            "the monitor to show the liar's escrowed compute forfeited",
        )

        done_at_ban = progress(trainer.lines())[-1][0]
        wait_until(lambda: progress(trainer.lines())[-1][0] >= done_at_ban + 12, 300, "training to go on after the ban")
    finally:
        if liar is not None:
            liar.stop(grace=20)
        swarm.stop()

    losses = [loss for _, loss in progress(trainer.lines())]
    assert len(losses) >= 4
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first, f"loss did not fall: {losses}"
    stats = [line for line in trainer.lines() if "[SPOTCHECK] checks=" in line]
    assert stats and stats[-1].endswith("bans=1"), stats[-1:]
