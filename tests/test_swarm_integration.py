"""A real swarm on loopback: 2 seeds, a trainer and workers for every stage, each its own process.

(That such a swarm learns, the loss falling by a nat while every stage steps, is test_checkpoint_integration's.)"""

from __future__ import annotations

import json
import signal

import pytest

from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from tests.swarm_helpers import events, progress, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("swarm")
    local = LocalSwarm(SwarmOptions(workers_per_stage=1, trainers=0, run_dir=run_dir, report_every=3.0))
    try:
        local.start()
        local.start_join_services(monitor=True)  # every role runs here, for the stop test
        local.start_worker("body1")  # a second body1 worker, killed in the second test
        local.start_trainer()
        yield local
    finally:
        local.stop()


def _trainer_progress(swarm: LocalSwarm) -> list[tuple[int, float]]:
    trainer = swarm.trainers[0]
    assert trainer.alive, f"the trainer exited; see {trainer.log_path}:\n" + "\n".join(trainer.lines()[-5:])
    return progress(trainer.lines())


def test_boundary_traffic_is_the_subspace_coefficients(swarm):
    """Measured from the serialized RPC payloads: k floats per token forward and back, plus the token id."""
    model = swarm.config.model
    assert model.subspace.enabled

    def traffic_lines() -> list[str]:
        _trainer_progress(swarm)  # the trainer is alive
        return [
            line
            for line in swarm.trainers[0].lines()
            if line.startswith("[TRAFFIC]") and "body1.backward_reply" in line
        ]

    wait_until(lambda: bool(traffic_lines()), timeout=240, what="a traffic report with body1's backward replies")
    traffic = json.loads(traffic_lines()[-1].split(" ", 1)[1])
    k, d = model.subspace_rank, model.d_model
    sent_forward = traffic["body1.forward_request"]  # coefficients + token ids into body1
    returned_backward = traffic["body1.backward_reply"]  # dL/dc out of body1, plus zeros for the token ids
    assert k * 4 + 8 <= sent_forward < (k * 4 + 8) * 1.05
    assert k * 4 + 8 <= returned_backward < (k * 4 + 8) * 1.05
    assert sent_forward < d * 4 / 4  # far below the dense hidden state


def test_sigkill_of_one_worker_does_not_stop_training(swarm):
    victim = swarm.workers["body1"][1]
    wait_until(lambda: _served(swarm, victim) > 0, timeout=120, what="the second body1 worker to get requests")
    done_before = _trainer_progress(swarm)[-1][0]
    victim.kill_main(signal.SIGKILL)
    wait_until(
        lambda: _trainer_progress(swarm)[-1][0] >= done_before + 15,
        timeout=240,
        what="15 more microbatches after the kill",
    )
    assert swarm.trainers[0].alive
    survivor = swarm.workers["body1"][0]
    assert survivor.alive


def test_every_role_stops_and_leaves_no_process(swarm):
    survivors = [process for process in swarm.processes if process.alive]  # all but the SIGKILLed worker
    assert {process.name.split("-")[0].rstrip("0123456789") for process in survivors} >= {
        "seed",
        "head",
        "body",
        "tail",
        "trainer",
        "auth",
        "monitor",
    }, [process.name for process in survivors]
    swarm.stop()  # SIGINT to each role, SIGKILL to its process group only after a 10 s grace
    assert swarm.leftover_pids() == []
    assert not any(process.alive for process in swarm.processes)


def _served(swarm: LocalSwarm, worker) -> int:
    path = swarm.options.run_dir / "events" / f"{worker.name}.jsonl"
    return sum(event["forward_per_min"] > 0 for event in events(path) if event["kind"] == "step")
