"""Two hosts in network namespaces joined by a veth pair: the swarm on one, the contributor on the other.

One swarm (preset tiny2: other shapes and stage count than tiny) serves the whole story, in order:
the contributor, given only the auth URL, first sits behind a firewall that drops its inbound port and
gets the reachability diagnosis (never a silent join); once the port is open it joins on its own
retry and reaches active; killed, it restarts with the same peer id and gets its slot back at once;
the slot of a peer that vanished is freed; and another account reusing its key is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from agora_client.events import json_objects
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from agora_client.swarm.processes import ManagedProcess
from tests.netns import TwoHosts, unavailable
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
_SKIP = unavailable(firewall=True)
RETRY_S = 3.0
VANISH_S = 20.0


@pytest.fixture(scope="module")
def hosts_and_swarm(tmp_path_factory):
    if _SKIP:
        pytest.skip(_SKIP)
    run_dir = tmp_path_factory.mktemp("two-hosts")
    with TwoHosts(f"agi11-{os.getpid()}") as hosts:
        swarm = LocalSwarm(SwarmOptions(preset="tiny2", workers_per_stage=1, run_dir=run_dir, publish_snapshots=True,
                                        publish_every=1, report_every=3, host=hosts.a.address))
        try:
            with hosts.a.entered():  # every role, the snapshot server included, lives on host a
                swarm.start()
                auth_url, _ = swarm.start_join_services(
                    pacing=1.0, users=("alice", "bob"),
                    auth_args=("--presence-every", "5", "--vanish-after", str(VANISH_S)),
                )
            yield hosts, swarm, auth_url
        finally:
            swarm.stop()


def _runtime(hosts: TwoHosts, name: str, auth_url: str, token: str, config_dir: Path, port: int, log_dir: Path) -> ManagedProcess:
    with hosts.b.entered():  # the contributor lives on host b and knows only the auth URL
        return ManagedProcess(
            name,
            ["runtime", "--cpu", "--swarm", auth_url, "--config-dir", str(config_dir), "--host-port", str(port),
             "--retry-every", str(RETRY_S)],
            log_dir / f"{name}.log",
            env={"HF_TOKEN": token},
        )


def _events(process: ManagedProcess, kind: str, **match) -> list[dict]:
    return [e for e in json_objects(process.lines()) if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def _status(hosts: TwoHosts, auth_url: str) -> dict:
    with hosts.b.entered():
        return httpx.get(f"{auth_url}/v1/status", timeout=10).json()


def _occupied(hosts: TwoHosts, auth_url: str) -> int:
    return int(_status(hosts, auth_url)["occupied"])


def test_contributor_on_another_host_joins_from_the_url_alone(hosts_and_swarm, tmp_path):
    hosts, swarm, auth_url = hosts_and_swarm
    tokens = swarm.tokens
    config_dir = tmp_path / "alice"
    port = hosts.b.free_port()
    runtimes: list[ManagedProcess] = []
    try:
        # Unreachable: host b drops new inbound connections to the worker's port.
        with hosts.b.drop_inbound_tcp(port):
            first = _runtime(hosts, "alice-1", auth_url, tokens["alice"], config_dir, port, tmp_path)
            runtimes.append(first)
            wait_until(lambda: len(_events(first, "reachability", status="unreachable")) >= 2 or not first.alive, 180,
                       "two failed dial-backs", poll=0.5)
            assert _events(first, "auth", status="authorized") == [] and _occupied(hosts, auth_url) == 0
        diagnosis = _events(first, "reachability", status="unreachable")[0]
        assert (diagnosis["port"], diagnosis["error"]) == (port, "timeout")
        assert diagnosis["tested_from"].startswith(hosts.a.address)  # dialled from the auth host, not from b
        assert f"{hosts.b.address}:{port} (TCP port {port}), tested from {hosts.a.address}" in diagnosis["advice"][0]
        assert any("security group" in line for line in diagnosis["advice"]) and diagnosis["retry_in_s"] == RETRY_S
        assert [e["status"] for e in _events(first, "preflight", check="reachability")][:1] == ["fail"]
        checks = {e["check"]: e["status"] for e in _events(first, "preflight")}
        assert {"gpu", "host_ram", "disk", "download_rate", "seed_rtt"} <= set(checks) and checks["seed_rtt"] == "pass"

        # The port is open now: the runtime's own retry joins, and the tiny2 stage it builds comes from the description.
        wait_until(lambda: bool(_events(first, "sync", phase="active")) or not first.alive, 300,
                   "the contributor to reach active", poll=0.5)
        assert first.alive, f"the runtime exited; see {first.log_path}"
        authorized = _events(first, "auth", status="authorized")[0]
        stage, slot, peer_id = authorized["stage"], authorized["slot"], authorized["peer_id"]
        assert stage in ("head", "body1", "tail")
        assert _events(first, "stage")[0]["peer_id"] == peer_id
        reached = _events(first, "reachability", status="reachable")
        assert reached and reached[0]["tested_from"].startswith(hosts.a.address) and reached[0]["port"] == port

        # A crash: the runtime is killed without leaving its slot, then its front end clears the process group
        # (as the app and the headless supervisor do). Restarted, it has the same peer id and gets the same slot
        # back without queueing.
        first.kill_main(signal.SIGKILL)
        first.stop(grace=5)
        second = _runtime(hosts, "alice-2", auth_url, tokens["alice"], config_dir, port, tmp_path)
        runtimes.append(second)
        wait_until(lambda: bool(_events(second, "auth", status="authorized")) or not second.alive, 180,
                   "the restarted runtime to be authorized", poll=0.5)
        again = _events(second, "auth", status="authorized")
        assert again and (again[0]["peer_id"], again[0]["stage"], again[0]["slot"]) == (peer_id, stage, slot)
        assert [event for event in _events(second, "queue") if event["position"] > 0] == []  # position 0: admitted at once

        # The restarted peer vanishes for good: its slot is freed within the vanish window, not at ticket expiry.
        wait_until(lambda: _status(hosts, auth_url)["stages"][stage]["active"] == 1 or not second.alive, 180,
                   "the restarted worker to report active", poll=1.0)
        second.kill_main(signal.SIGKILL)
        second.stop(grace=5)
        wait_until(lambda: _occupied(hosts, auth_url) == 0, 120, "the vanished peer's slot to be freed", poll=2.0)

        # Bob copies alice's key (while it is not in use, so libp2p lets him start): the auth service refuses him.
        copied = tmp_path / "bob"
        shutil.copytree(config_dir / "identity", copied / "identity")
        third = _runtime(hosts, "bob", auth_url, tokens["bob"], copied, hosts.b.free_port(), tmp_path)
        runtimes.append(third)
        wait_until(lambda: not third.alive, 180, "the runtime with a borrowed key to be turned away", poll=0.5)
        assert third.proc.returncode == 3, f"see {third.log_path}"
        rejected = _events(third, "auth", status="rejected")
        assert rejected and "belongs to another Hugging Face account, not to bob" in rejected[0]["message"]
        assert _occupied(hosts, auth_url) == 0
    finally:
        for runtime in runtimes:
            runtime.stop(grace=20)
