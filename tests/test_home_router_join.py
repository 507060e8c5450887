"""A contributor behind a home router (tests/netns_router.py: a real miniupnpd and a masquerading nftables
router in network namespaces) joins a swarm on the internet side, which it knows by its URL alone.

One swarm (preset tiny2: other shapes and stage count than tiny), with the operator's relay on its host,
serves the whole story, in order: with no UPnP on the router and the relay out of reach, the client says
what its network does and what to do, tries the relay at once, then retries without crashing (never a silent
join); with the router refusing to map by its rules and the relay in reach, its retry serves through the
relay, is dialed back there and processes batches; stopped with Ctrl-C, the relay's port and the slot are
freed at once. With UPnP on, restarted with the same peer id, it maps the port, is dialed back through the
forward and processes batches; killed, it leaves its forward for the lease's end and its slot is freed once it has
vanished from the DHT; another account reusing its key is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

import httpx
import pytest

from agora_client.events import json_objects
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from agora_client.swarm.processes import ManagedProcess
from tests.netns_router import HomeRouter, unavailable
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
_SKIP = unavailable()
RETRY_S = 3.0
VANISH_S = 10.0


@pytest.fixture(scope="module")
def router_and_swarm(tmp_path_factory):
    if _SKIP:
        pytest.skip(_SKIP)
    run_dir = tmp_path_factory.mktemp("home-router")
    with HomeRouter(f"agi25-{os.getpid()}") as net:
        swarm = LocalSwarm(
            SwarmOptions(
                preset="tiny2",
                workers_per_stage=1,
                run_dir=run_dir,
                publish_snapshots=True,
                publish_every=1,
                report_every=3,
                host=net.internet.address,
            )
        )
        try:
            with net.internet.entered():  # every role of the swarm lives on the internet side
                swarm.start()
                auth_url, _ = swarm.start_join_services(
                    pacing=1.0,
                    users=("alice", "bob"),
                    relay=True,
                    auth_args=("--presence-every", "5", "--vanish-after", str(VANISH_S)),
                )
            yield net, swarm, auth_url
        finally:
            swarm.stop()


def _runtime(net: HomeRouter, name: str, auth_url: str, token: str, config_dir: Path, log_dir: Path) -> ManagedProcess:
    with net.home.entered():  # the contributor lives at home, behind the router
        return ManagedProcess(
            name,
            [
                "runtime",
                "--cpu",
                "--swarm",
                auth_url,
                "--config-dir",
                str(config_dir),
                "--host-port",
                "0",
                "--retry-every",
                str(RETRY_S),
                "--insecure",
            ],  # the swarm's plain http:// is on the internet side (11.77.0.x)
            log_dir / f"{name}.log",
            env={"HF_TOKEN": token},
        )


def _events(process: ManagedProcess, kind: str, **match) -> list[dict]:
    return [
        e for e in json_objects(process.lines()) if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())
    ]


def _logs(process: ManagedProcess, tag: str) -> list[str]:
    return [event["message"] for event in _events(process, "log", tag=tag)]


def _status(net: HomeRouter, auth_url: str) -> dict:
    with net.internet.entered():
        return httpx.get(f"{auth_url}/v1/status", timeout=10).json()


def _occupied(net: HomeRouter, auth_url: str) -> int:
    return int(_status(net, auth_url)["occupied"])


def _wait_active(runtime: ManagedProcess) -> None:
    wait_until(
        lambda: bool(_events(runtime, "sync", phase="active")) or not runtime.alive,
        300,
        "the contributor to reach active",
        poll=0.5,
    )
    assert runtime.alive, f"the runtime exited; see {runtime.log_path}"


def _relay(net: HomeRouter, auth_url: str) -> str:
    with net.internet.entered():
        return httpx.get(f"{auth_url}/v1/run", timeout=10).json()["relays"][0]


def _refused(net: HomeRouter, address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with net.internet.entered():
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except ConnectionRefusedError:
            return True
    return False


def _wait_batches(runtime: ManagedProcess) -> None:
    wait_until(
        lambda: any(e["backward_total"] > 0 for e in _events(runtime, "traffic")) or not runtime.alive,
        300,
        f"{runtime.name} to process a batch",
        poll=1.0,
    )
    assert runtime.alive, f"the runtime exited; see {runtime.log_path}"


def test_relay_and_upnp_contributor_behind_a_home_router_joins_without_a_manual_step(router_and_swarm, tmp_path):
    net, swarm, auth_url = router_and_swarm
    relay, config_dir = _relay(net, auth_url), tmp_path / "alice"
    runtimes: list[ManagedProcess] = []
    try:
        # No UPnP on the router and the relay out of reach: the client says what its network does and retries.
        net.switch_upnp("off")
        with net.blocked(*relay.split(":")):
            first = _runtime(net, "alice-1", auth_url, swarm.tokens["alice"], config_dir, tmp_path)
            runtimes.append(first)
            # right after the failed dial-back the client tries the relay, out of reach (one line); the next failed
            # dial-back waits for the retry
            wait_until(
                lambda: len(_events(first, "reachability", status="unreachable")) >= 2 or not first.alive,
                180,
                "a failed dial-back, the relay out of reach, then a second failed dial-back",
                poll=0.5,
            )
        assert first.alive and _events(first, "auth", status="authorized") == [] and _occupied(net, auth_url) == 0
        _check_diagnosis(net, first, relay)

        # The router refuses mapping by its rules, but the relay answers now: the retry serves through it.
        net.switch_upnp("denied")
        _wait_active(first)
        reached = _events(first, "reachability", status="reachable")[0]
        assert (reached["path"], reached["relay"]) == ("relayed", relay) and "ms more per round trip" in reached[
            "relay_cost"
        ]
        relayed_at = reached["address"]
        assert relayed_at.startswith(relay.split(":")[0] + ":") and net.mappings() == []
        assert any("refused to forward" in line for line in _logs(first, "NETWORK"))
        _wait_batches(first)
        authorized = _events(first, "auth", status="authorized")[0]
        stage, peer_id = authorized["stage"], authorized["peer_id"]

        # Ctrl-C: the relay frees the port it held and the slot is given back at once.
        first.stop(grace=30)
        assert _events(first, "exit")[-1]["code"] == 0, f"see {first.log_path}"
        assert _occupied(net, auth_url) == 0 and _refused(net, relayed_at)

        # UPnP on: restarted with the same peer id, it maps the port and is dialed back through the forward.
        net.switch_upnp("on")
        second = _runtime(net, "alice-2", auth_url, swarm.tokens["alice"], config_dir, tmp_path)
        runtimes.append(second)
        _wait_active(second)
        assert _events(second, "auth", status="authorized")[0]["peer_id"] == peer_id
        [forward] = net.mappings()
        reached = _events(second, "reachability", status="reachable")[0]
        assert reached["path"] == "mapped" and reached["tested_from"].startswith(net.internet.address)
        assert reached["address"] == f"{net.wan_address}:{forward.external_port}"  # dialed through the forward
        assert forward.internal_address == net.home.address
        _wait_batches(second)

        # A crash: killed without leaving, its forward stays until the lease ends and its slot is freed once
        # it has vanished from the stage's roster (the vanish window, not the ticket's expiry).
        wait_until(lambda: _status(net, auth_url)["stages"][stage]["active"] == 1, 180, "the worker to report active")
        second.kill_main(signal.SIGKILL)
        second.stop(grace=5)
        wait_until(lambda: _occupied(net, auth_url) == 0, 120, "the vanished peer's slot to be freed", poll=2.0)
        assert net.mappings() == [forward]
        _borrowed_key_is_refused(net, swarm, auth_url, config_dir, tmp_path, runtimes)
        assert net.mappings() == [forward]  # bob's own forward went with him
    finally:
        for runtime in runtimes:
            runtime.stop(grace=20)


def _check_diagnosis(net: HomeRouter, runtime: ManagedProcess, relay: str) -> None:
    assert any("no router on this network answered a UPnP search" in line for line in _logs(runtime, "NETWORK"))
    assert any(line.startswith(f"Relay {relay}:") for line in _logs(runtime, "NETWORK"))  # out of reach: one line
    diagnosis = _events(runtime, "reachability", status="unreachable")[0]
    assert diagnosis["error"] == "timeout" and diagnosis["tested_from"].startswith(net.internet.address)
    assert f"{net.wan_address}:{diagnosis['port']} (TCP port {diagnosis['port']})" in diagnosis["advice"][0]
    network = diagnosis["network"]
    assert (network["local_address"], network["seen_address"]) == (net.home.address, net.wan_address)
    assert network["nat"] and not network["carrier_grade_nat"] and network["mapping"] == "not offered"
    assert any("Turn on UPnP" in line for line in diagnosis["advice"])
    # the relay was tried at once, without the retry's wait; the dial-back after it waits
    failed_dials = _events(runtime, "reachability", status="unreachable")[:2]
    assert [(d["retry_in_s"], d["trying_relay"]) for d in failed_dials] == [(None, True), (RETRY_S, False)]
    checks = {e["check"]: e["status"] for e in _events(runtime, "preflight")}
    assert checks["reachability"] == "fail" and checks["seed_rtt"] == "pass"


def _borrowed_key_is_refused(net, swarm, auth_url, config_dir, tmp_path, runtimes) -> None:
    """Bob copies alice's key (while it is not in use, so libp2p lets him start): the auth service refuses him."""
    copied = tmp_path / "bob"
    shutil.copytree(config_dir / "identity", copied / "identity")
    bob = _runtime(net, "bob", auth_url, swarm.tokens["bob"], copied, tmp_path)
    runtimes.append(bob)
    wait_until(lambda: not bob.alive, 180, "the runtime with a borrowed key to be turned away", poll=0.5)
    assert bob.proc.returncode == 3, f"see {bob.log_path}"
    rejected = _events(bob, "auth", status="rejected")
    assert rejected and "belongs to another Hugging Face account, not to bob" in rejected[0]["message"]
    assert _occupied(net, auth_url) == 0
