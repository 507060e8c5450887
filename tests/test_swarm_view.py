"""The swarm view's data (SwarmEvent.stages): workers by phase from a real DHT roster on loopback, the queue
and capacity from a real auth service's /v1/status, the trainers' spot checks merged, the replica drift from the
workers' signed metrics records on real signing DHT nodes; old events still parse."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from hivemind import DHT
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth.tickets import generate_signing_key, issue_ticket, public_key_text
from agora_client.config import load_config
from agora_client.discovery.progress_records import CheckStanding, StageSpotChecks, TrainerProgress
from agora_client.discovery.roster import WorkerRecord, announce
from agora_client.events import SwarmEvent, dump_event, parse_event
from agora_client.joining.swarm_view import StageWatch, spot_check_status
from agora_client.monitor.records import create_signed_dht, publish_metrics
from agora_client.worker.metrics import WorkerMetrics
from tests.replays import FIXTURES
from tests.test_auth import auth_service, join

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def dht():
    node = DHT(start=True, host_maddrs=LOOPBACK)
    try:
        yield node
    finally:
        node.shutdown()


def checks(count: int, forward: str, backward: str | None = None, strikes: int = 0) -> StageSpotChecks:
    def standing(state: str) -> CheckStanding:
        return CheckStanding(state=state, tolerance=None if state == "calibrating" else 0.1, samples=count)

    return StageSpotChecks(
        checks=count, strikes=strikes, bans=0, forward=standing(forward), backward=standing(backward or forward)
    )


def test_the_trainers_spot_checks_of_a_stage_add_up_and_stand_where_its_less_judged_kind_stands():
    both = spot_check_status([checks(30, "verifiable", "calibrating", strikes=1), checks(20, "calibrating")])
    assert (both.checks, both.strikes, both.bans, both.state) == (50, 1, 0, "calibrating")  # no trainer judges backward
    # a kind is judged when one trainer can judge it, as the monitor's page says
    assert (
        spot_check_status([checks(5, "verifiable", "calibrating"), checks(5, "calibrating", "verifiable")]).state
        == "verifiable"
    )
    assert (
        spot_check_status([checks(5, "unverifiable", "calibrating")]).state == "unverifiable"
    )  # will not change by waiting
    assert spot_check_status([]) is None


def test_each_stage_counts_its_workers_by_phase_its_queue_and_its_spot_checks(dht, tmp_path: Path):
    workers = [
        ("a", "head", 0, True, False),
        ("b", "head", 1, True, False),
        ("c", "head", 2, True, False),
        ("d", "head", 0, False, False),
        ("e", "tail", 0, True, False),
        ("f", "head", 0, True, True),
    ]
    for peer, stage, phase, healthy, yielding in workers:
        record = WorkerRecord(
            uid=f"{stage}.0.{peer}", peer_id=peer, stage=stage, sync_phase=phase, healthy=healthy, yielding=yielding
        )
        assert announce(dht, record, ttl=60)
    trainer = TrainerProgress(peer_id="t", microbatches=1, spot_checks={"head": checks(12, "verifiable")}, ts=1.0)
    users = ("alice", "bob", "carol", "dave")
    with auth_service(tmp_path, users, stages=("head", "body1", "tail"), pacing_s=60.0, max_workers_per_stage=4) as (
        server,
        tokens,
    ):
        for user in users[:3]:  # one admitted per stage: the next joiner of each stage waits for the pacing
            join(server, tokens[user], user)
        queued = httpx.post(f"{server.url}/v1/join", json={"token": tokens["dave"], "peer_id": "dave"}).json()
        watch = StageWatch(server.url, ("head", "body1", "tail"))
        stages = {stage.stage: stage for stage in watch.read(dht, [trainer], None)}
    waiting = queued["stage"]
    assert queued["status"] == "queued" and stages[waiting].queued == 1
    assert all(stage.queued == 0 and stage.capacity == 4 for name, stage in stages.items() if name != waiting)
    head = stages["head"]
    assert (head.active, head.syncing, head.unhealthy, head.yielding) == (
        1,
        2,
        1,
        1,
    )  # a yielding worker serves nothing
    assert head.spot_checks is not None and (head.spot_checks.checks, head.spot_checks.state) == (12, "verifiable")
    assert (stages["tail"].active, stages["tail"].spot_checks) == (1, None)
    assert (stages["body1"].active, stages["body1"].syncing) == (0, 0)


def test_without_an_answer_from_the_auth_service_queue_and_capacity_are_unknown(dht):
    stages = StageWatch("http://127.0.0.1:9", ("head",)).read(dht, [], None)  # nothing listens on the discard port
    assert (stages[0].queued, stages[0].capacity) == (None, None)


def test_each_stage_shows_the_mean_drift_of_its_workers_verified_metrics_records(tmp_path: Path):
    auth_key, stranger_key, model = generate_signing_key(), generate_signing_key(), load_config("tiny").model
    workers = [create_signed_dht(tmp_path / "0.id", RSAPrivateKey(), host_maddrs=LOOPBACK)]
    peers = [str(address) for address in workers[0][0].get_visible_maddrs()]
    workers += [
        create_signed_dht(tmp_path / f"{index}.id", RSAPrivateKey(), initial_peers=peers, host_maddrs=LOOPBACK)
        for index in (1, 2)
    ]
    try:
        # two workers that averaged, and one whose ticket another auth service signed (records without a drift:
        # tests/test_replica_drift.py)
        for (dht, validator), drift, key in zip(
            workers, (0.02, 0.05, 0.9), (auth_key, auth_key, stranger_key), strict=True
        ):
            peer_id = dht.peer_id.to_base58()
            ticket = issue_ticket(key, identity=peer_id[-6:], peer_id=peer_id, stage="body1", slot=0, ttl_s=3600)
            metrics = WorkerMetrics(model, "body1", peer_id=peer_id, identity=peer_id[-6:], ticket=ticket)
            metrics.set_phase("active")
            metrics.on_sparta_round(True, 1.0, drift, drift / 10)
            assert publish_metrics(dht, metrics.snapshot(), validator, ttl=60)
        watch = StageWatch("http://127.0.0.1:9", ("body1", "tail"))
        stages = {stage.stage: stage for stage in watch.read(workers[0][0], [], public_key_text(auth_key))}
        assert stages["body1"].drift == pytest.approx((0.02 + 0.05) / 2)  # the stranger's record is not counted
        assert stages["tail"].drift is None  # no worker there has averaged
        assert all(stage.drift is None for stage in watch.read(workers[0][0], [], None))  # no key: nothing verified
    finally:
        for dht, _ in reversed(workers):
            dht.shutdown()


def test_a_swarm_event_recorded_before_the_swarm_view_still_parses():
    old = next(line for line in (FIXTURES / "active.jsonl").read_text().splitlines() if '"kind":"swarm"' in line)
    assert "stages" not in json.loads(old)
    event = parse_event(old)
    assert isinstance(event, SwarmEvent) and (event.stage, event.stages) == ("", [])
    assert parse_event(dump_event(event)) == event
