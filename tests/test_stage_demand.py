"""Stages staffed by demand: targets from the plan's compute per stage or the operator's, and the real auth service
giving each joiner the stage the pipeline is shortest of among those its GPU holds."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from agora_client.auth import (
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    swarm_status,
    write_demo_token_file,
)
from agora_client.auth import main as auth_main
from agora_client.auth.admission import AdmissionPolicy, Admitted, SlotBook
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.auth.stage_demand import even_demand, parse_stage_targets, plan_demand, run_demand
from agora_client.config import load_config
from agora_client.deploy import DeployError, load_spec, plan_roles, prepare_secrets
from agora_client.events import EventWriter
from agora_client.model.memory import flops_per_microbatch

GIB = 1 << 30
HOLDS_TAIL = {"gpu_memory": 48 * GIB, "host_memory": 64 * GIB}
NOT_THE_TAIL = {"gpu_memory": 48 * GIB, "host_memory": 24 * GIB}  # the tail's host side needs 33 GiB in fp32
EIGHT_B = load_config("8b")
EXAMPLE_DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "example.yaml"


# -- the demand computation -------------------------------------------------------------------------------


def test_targets_follow_the_compute_per_stage():
    demand = plan_demand({"head": 50, "body1": 25, "tail": 100}, most=8)
    assert [(need.stage, need.target, need.source) for need in demand.needs] == [
        ("head", 4.0, "plan"),
        ("body1", 2.0, "plan"),
        ("tail", 8.0, "plan"),
    ]
    # one worker each: the tail has the fewest for its compute, the body the most
    assert demand.fill("tail", 1) < demand.fill("head", 1) < demand.fill("body1", 1)
    assert demand.fill("body1", 2) == demand.fill("tail", 8) == 1.0


def test_the_8b_plan_asks_three_times_the_workers_of_a_body_for_the_tail():
    demand = run_demand(EIGHT_B, most=9)
    microbatch = EIGHT_B.optim.microbatch_size
    targets = {need.stage: need.target for need in demand.needs}
    assert targets["tail"] == 9.0
    assert targets["body1"] == pytest.approx(
        9
        * flops_per_microbatch(EIGHT_B.model, "body1", microbatch)
        / flops_per_microbatch(EIGHT_B.model, "tail", microbatch)
    )
    assert 2.5 < targets["body1"] < 3.5 and targets["body1"] < targets["head"] < targets["tail"]
    assert demand.to_json()["tail"]["flops_per_microbatch"] == flops_per_microbatch(EIGHT_B.model, "tail", microbatch)


def test_the_operator_overrides_a_stage_target():
    demand = plan_demand({"head": 50, "body1": 25, "tail": 100}, most=8, overrides={"tail": 2})
    assert demand.to_json()["tail"] == {"target_workers": 2.0, "source": "operator", "flops_per_microbatch": 100}
    assert demand.to_json()["head"]["source"] == "plan"
    with pytest.raises(ValueError, match="names no stage of this run: body9"):
        plan_demand({"head": 1, "tail": 2}, most=8, overrides={"body9": 2})
    with pytest.raises(ValueError, match=r"tail=9: a target must be a whole number of workers from 1 to .* \(8"):
        plan_demand({"head": 1, "tail": 2}, most=8, overrides={"tail": 9})


def test_stage_targets_parse_or_say_what_is_wrong():
    assert parse_stage_targets(["tail=6", " head = 2"]) == {"tail": 6, "head": 2}
    for bad in ("tail", "tail=", "=3", "tail=six", "tail=-1", "tail=1.5"):
        with pytest.raises(ValueError, match="is not STAGE=N"):
            parse_stage_targets([bad])
    with pytest.raises(ValueError, match="names stage tail twice"):
        parse_stage_targets(["tail=2", "tail=3"])


def test_the_book_fills_the_stage_shortest_for_its_target():
    demand = plan_demand({"head": 50, "body1": 25, "tail": 100}, most=8)
    policy = AdmissionPolicy(
        stages=("head", "body1", "tail"), per_identity_cap=99, pacing_s=0.0, max_pending_per_stage=99, demand=demand
    )
    book = SlotBook(policy)
    stages = []
    for index in range(7):
        decision = book.join("a", f"p{index}", now=0.0)
        assert isinstance(decision, Admitted)
        stages.append(decision.slot.stage)
    # all empty: pipeline order; then the tail (1/8) before the head (1/4) and the body (1/2); ties to pipeline order
    assert stages == ["head", "body1", "tail", "tail", "head", "tail", "tail"]
    assert book.next_stage(now=0.0) == "head"  # head 2/4, body1 1/2, tail 4/8: pipeline order
    with pytest.raises(ValueError, match="must name the policy's stages"):
        AdmissionPolicy(stages=("head", "tail"), demand=demand)


def test_without_a_plan_every_stage_counts_alike():
    policy = AdmissionPolicy(stages=("head", "tail"), pacing_s=0.0, max_pending_per_stage=9)
    assert policy.stage_demand == even_demand(("head", "tail"), 8)
    book = SlotBook(policy)
    assert [book.join(f"u{i}", f"p{i}", now=0.0).slot.stage for i in range(3)] == ["head", "tail", "head"]


def test_the_flag_reaches_the_policy_and_a_bad_one_stops_the_start(tmp_path: Path):
    parser = argparse.ArgumentParser()
    auth_main.configure(parser)
    tiny = load_config("tiny")
    args = parser.parse_args(["--state-dir", str(tmp_path), "--stage-target", "tail=6", "--stage-target", "head=1"])
    demand = auth_main.build_settings(args, tiny).policy.stage_demand.to_json()
    assert (demand["tail"]["target_workers"], demand["tail"]["source"]) == (6.0, "operator")
    assert (demand["head"]["target_workers"], demand["head"]["source"]) == (1.0, "operator")
    assert demand["body1"]["source"] == "plan"
    with pytest.raises(ValueError, match="from 1 to the most a stage may hold \\(4"):
        auth_main.build_settings(parser.parse_args(["--max-workers-per-stage", "4", "--stage-target", "tail=5"]), tiny)


# -- the real auth service --------------------------------------------------------------------------------


@contextmanager
def auth_service(tmp_path: Path, overrides: dict[str, int] | None = None):
    token_file = tmp_path / "tokens.json"
    token = write_demo_token_file(token_file, "operator")
    summary = TokenizerSummary("0" * 64, EIGHT_B.model.vocab_size, EIGHT_B.tokenizer.eos_token)  # offline
    run = describe_run(EIGHT_B, ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",), None, None, summary)
    policy = AdmissionPolicy(
        stages=EIGHT_B.model.stage_names,
        per_identity_cap=99,
        pacing_s=0.0,
        max_pending_per_stage=99,
        demand=run_demand(EIGHT_B, 8, overrides),
    )
    settings = ServiceSettings(policy=policy, seeds=("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",), run=run)
    with AuthServer(AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")) as server:
        yield server, token


def join(server: AuthServer, token: str, peer_id: str, memory: dict[str, int]) -> str:
    return authorize(server.url, token, peer_id, events=EventWriter(), poll_every=0.05, **memory).stage


def one_per_stage(server: AuthServer, token: str) -> None:
    stages = [join(server, token, f"first{index}", HOLDS_TAIL) for index in range(len(EIGHT_B.model.stage_names))]
    assert stages == list(EIGHT_B.model.stage_names)  # every stage empty in turn: pipeline order


def test_with_the_tail_short_the_next_joiner_that_holds_it_gets_it(tmp_path: Path):
    with auth_service(tmp_path) as (server, token):
        one_per_stage(server, token)
        assert swarm_status(server.url)["next_stage"] == "tail"
        # one worker each: fill order would give the head; the tail's compute asks for three bodies' worth
        assert join(server, token, "big", HOLDS_TAIL) == "tail"
        assert join(server, token, "big2", HOLDS_TAIL) == "head"  # tail 2/8 > head 1/4.2
        assert join(server, token, "big3", HOLDS_TAIL) == "tail"
        status = swarm_status(server.url)
    assert status["demand"]["tail"]["source"] == "plan" and status["demand"]["tail"]["target_workers"] == 8
    assert 2.5 < status["demand"]["body1"]["target_workers"] < 3.5
    assert status["stages"]["tail"]["pending"] == 3 and status["stages"]["body1"]["pending"] == 1


def test_a_joiner_that_cannot_hold_the_tail_gets_the_next_shortest_stage(tmp_path: Path):
    with auth_service(tmp_path) as (server, token):
        one_per_stage(server, token)
        assert join(server, token, "small", NOT_THE_TAIL) == "head"  # head 1/4.2 before the bodies' 1/2.8
        assert join(server, token, "small2", NOT_THE_TAIL) == "body1"  # head 2/4.2 > body1 1/2.8
        assert join(server, token, "big", HOLDS_TAIL) == "tail"  # still the shortest


def test_the_operators_target_wins_over_the_plan(tmp_path: Path):
    with auth_service(tmp_path, overrides={"body3": 8, "tail": 2}) as (server, token):
        one_per_stage(server, token)
        # the plan would give the tail (1/8), fill order the head: body3 is now the shortest (1/8; tail 1/2)
        assert join(server, token, "big", HOLDS_TAIL) == "body3"
        assert join(server, token, "big2", HOLDS_TAIL) == "head"  # body3 2/8 > head 1/4.2
        status = swarm_status(server.url)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert status["demand"]["tail"] == {
        "target_workers": 2.0,
        "source": "operator",
        "flops_per_microbatch": flops_per_microbatch(EIGHT_B.model, "tail", EIGHT_B.optim.microbatch_size),
    }
    assert 'agora_auth_stage_target{stage="tail"} 2.0' in metrics


def test_the_deploy_file_sets_the_auth_services_stage_targets(tmp_path: Path):
    data = yaml.safe_load(EXAMPLE_DEPLOY.read_text())
    data["run"]["dir"], data["secrets"] = str(tmp_path / "run"), str(tmp_path / "secrets")
    data["stores"] = {"snapshots": str(tmp_path / "snapshots"), "checkpoints": str(tmp_path / "checkpoints")}
    data["hosts"]["operator"]["roles"]["auth"]["stage_targets"] = {"tail": 6, "head": 2}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(path)
    steps = plan_roles(spec, "operator", prepare_secrets(spec, "operator"))
    args = next(launch.args for step in steps for launch in step if launch.name == "auth")
    given = [args[index + 1] for index, arg in enumerate(args) if arg == "--stage-target"]
    assert parse_stage_targets(given) == {"tail": 6, "head": 2}
    data["hosts"]["operator"]["roles"]["auth"]["stage_targets"] = {"tail": 0}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(DeployError, match="stage_targets"):
        load_spec(path)
