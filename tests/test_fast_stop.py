"""A stopping contributor frees its slot before anything slow runs (issue 24: stops are fast at any size).

A real auth service (token file identities) admits a contributor whose worker is a real in-process
WorkerNode on a seed DHT. The test holds the first step of the stop that may take long (the averaging
group's leave, which waits for a round in flight; the epochs and the server come after it) and, while it
is held, sees that the auth service already counts the slot free and that the stage's roster no longer
lists the worker.
"""

from __future__ import annotations

import threading

import hivemind
import pytest

from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    swarm_status,
    write_demo_token_file,
)
from agora_client.auth.client import authorize
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.config import load_config
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.discovery.roster import fetch_roster
from agora_client.events import EventWriter
from agora_client.joining.contributor import Contributor, ContributorOptions
from agora_client.worker.node import WorkerNode, WorkerOptions
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STAGE = "body1"


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def write(self, line: str) -> None:
        self.events.append(line)

    def flush(self) -> None:
        pass


class HeldStep:
    """Stands in for a slow step of the stop: says when it is reached, then waits for the test's release."""

    def __init__(self, step) -> None:
        self.step, self.reached, self.release = step, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.reached.set()
        assert self.release.wait(120), "the test never released the held step"
        return self.step(*args, **kwargs)


@pytest.fixture
def admitted(tmp_path):
    """(auth service URL, contributor options, its authorization, seed DHT, seed maddrs) for one admitted peer."""
    config = load_config("tiny")
    token = write_demo_token_file(tmp_path / "tokens.json", "alice")
    seed = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    seeds = tuple(str(maddr) for maddr in seed.get_visible_maddrs())
    tokenizer = load_run_tokenizer(config)
    run = describe_run(config, seeds, None, None, TokenizerSummary.of(tokenizer))
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=(STAGE,), pacing_s=0.0), seeds=seeds, run=run, tokenizer_json=tokenizer.content
    )
    try:
        with AuthServer(AuthService(settings, TokenFileIdentity(tmp_path / "tokens.json"), tmp_path / "state")) as auth:
            options = ContributorOptions(swarm_url=auth.url, run=run, config_dir=tmp_path / "client", host_port=0)
            yield auth.url, options, token, seed, list(seeds)
    finally:
        seed.shutdown()


def test_a_stop_frees_the_slot_and_leaves_the_roster_before_the_slow_part(admitted) -> None:
    auth_url, options, token, seed, seeds = admitted
    sink = Recorder()
    events = EventWriter(sink)
    node = WorkerNode(WorkerOptions(options.run.config, STAGE, seeds, index=0), events)
    contributor = Contributor(options, events, threading.Event())
    contributor.node = node
    contributor.auth = authorize(auth_url, token, node.peer_id, events=events)
    node.start()
    wait_until(lambda: node.peer_id in fetch_roster(seed, STAGE), 60, "the worker in its stage's roster", poll=0.2)
    assert swarm_status(auth_url)["occupied"] == 1

    # The averaging group's leave waits for a round in flight (up to its bound): the first step that may be slow.
    held_averager = node.sparta.shutdown = HeldStep(node.sparta.shutdown)
    held_server = node.server.shutdown = HeldStep(node.server.shutdown)
    held_server.release.set()  # only the first slow step is held
    closing = threading.Thread(target=contributor.close, name="close")
    closing.start()
    try:
        assert held_averager.reached.wait(60), "the stop never reached its slow part"
        assert swarm_status(auth_url)["occupied"] == 0, "the slot was still held when the slow part began"
        assert node.peer_id not in fetch_roster(seed, STAGE), (
            "the worker was still in the roster when the slow part began"
        )
        assert not held_server.reached.is_set()
    finally:
        held_averager.release.set()
        closing.join(60)
    assert not closing.is_alive(), "the stop did not finish once its slow part was released"
    assert held_server.reached.is_set() and not node.dht.is_alive()
    assert not any("could not release the slot" in line for line in sink.events), sink.events


def test_a_contributor_stopped_before_its_worker_exists_frees_its_slot(admitted) -> None:
    auth_url, options, token, seed, _ = admitted
    events = EventWriter(Recorder())
    contributor = Contributor(options, events, threading.Event())
    contributor.auth = authorize(auth_url, token, seed.peer_id.to_base58(), events=events)
    assert swarm_status(auth_url)["occupied"] == 1
    contributor.close()  # as when stopped during the queue or the snapshot download
    assert swarm_status(auth_url)["occupied"] == 0
