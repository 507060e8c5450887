"""A swarm across hosts (issue 28): four network namespaces on one bridge. The operator's host runs every role of
the swarm from a deploy file alone (`agora deploy up --detach`, which returns once every role is ready); three
contributor hosts join with only the auth service's URL (and the CPU opt-in), process batches and show up in
the monitor's leaderboard; `agora deploy down` then stops everything on the operator's host, p2p daemons included.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from agora_client.auth.identity import write_demo_token_file
from agora_client.events import json_objects
from agora_client.swarm.processes import CLI, ManagedProcess, stop_all
from tests.netns import BridgedHosts, Host, unavailable
from tests.swarm_helpers import wait_until
from tests.test_operator_metrics import scrape, value

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
_SKIP = unavailable()
USERS = ("alice", "bob", "carol")
AUTH_PORT, MONITOR_PORT, METRICS_PORT = 8440, 8090, 9400


def _deploy_file(tmp_path: Path, operator: Host) -> Path:
    """The operator's whole swarm.

    Seeds, snapshot server, auth (local identities), monitor, a worker per stage, a trainer."""
    spec = {
        "run": {"config": "tiny2", "dir": "run"},
        "secrets": "secrets",
        "stores": {"snapshots": "snapshots"},
        "hosts": {
            "operator": {
                "address": operator.address,
                "metrics": {"port": METRICS_PORT, "listen": operator.address},
                "roles": {
                    "seeds": {"count": 2},
                    "snapshot_server": {"port": 8080},
                    "auth": {
                        "port": AUTH_PORT,
                        "identity": "token-file",
                        "token_file": "secrets/tokens.json",
                        "pacing": 1.0,
                    },
                    "monitor": {"port": MONITOR_PORT, "interval": 3.0},
                    "workers": {"per_stage": 1, "publish_every": 1, "device": "cpu"},
                    "trainers": {"count": 1, "report_every": 3.0},
                },
            }
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _events(process: ManagedProcess, kind: str) -> list[dict]:
    return [event for event in json_objects(process.lines()) if event["kind"] == kind]


def _processed_a_batch(runtime: ManagedProcess) -> bool:
    return any(event["backward_total"] > 0 for event in _events(runtime, "traffic"))


def _leaderboard_names(operator: Host) -> set[str]:
    with operator.entered():
        rows = httpx.get(f"http://{operator.address}:{MONITOR_PORT}/leaderboard", timeout=10).json()["rows"]
    return {row["username"] for row in rows}


def _check_metrics(operator: Host) -> None:
    """Seeds, then the operator's first worker (head-0), take the first metrics ports; auth serves its own."""
    with operator.entered():
        seed, head, auth = (
            scrape(f"http://{operator.address}:{port}/metrics") for port in (METRICS_PORT, METRICS_PORT + 2, AUTH_PORT)
        )
    assert value(seed, "agora_seed_dht_peers") >= 1
    assert value(head, "agora_worker_rpc_requests_total", stage="head", kind="forward") > 0
    assert value(auth, "agora_auth_joins_total", outcome="authorized") >= len(USERS)


def test_operator_host_from_a_deploy_file_and_contributors_with_only_the_url(tmp_path):
    if _SKIP:
        pytest.skip(_SKIP)
    with BridgedHosts(f"agi28-{os.getpid()}", 1 + len(USERS)) as hosts:
        operator, homes = hosts[0], hosts.hosts[1:]
        deploy_file = _deploy_file(tmp_path, operator)
        tokens = {user: write_demo_token_file(tmp_path / "secrets" / "tokens.json", user) for user in USERS}
        runtimes: list[ManagedProcess] = []
        try:
            with operator.entered():  # the roles start in the operator's namespace, where `up` runs
                up = subprocess.run(
                    [*CLI, "deploy", "up", str(deploy_file), "--detach"], capture_output=True, text=True, timeout=240
                )
            assert up.returncode == 0, up.stdout + up.stderr
            assert f"[DEPLOY] auth ready: http://{operator.address}:{AUTH_PORT}\n" in up.stdout
            for home, user in zip(homes, USERS, strict=True):
                with home.entered():  # only the URL and the CPU opt-in: everything else comes from the swarm
                    runtimes.append(
                        ManagedProcess(
                            user,
                            [
                                "runtime",
                                "--cpu",
                                "--swarm",
                                f"http://{operator.address}:{AUTH_PORT}",
                                "--config-dir",
                                str(tmp_path / user),
                            ],
                            tmp_path / f"{user}.log",
                            env={"HF_TOKEN": tokens[user]},
                        )
                    )
            for runtime in runtimes:
                wait_until(
                    lambda runtime=runtime: _processed_a_batch(runtime) or not runtime.alive,
                    240,
                    f"{runtime.name} to process a batch",
                )
                assert runtime.alive, f"{runtime.name} exited; see {runtime.log_path}"
            wait_until(lambda: set(USERS) <= _leaderboard_names(operator), 90, "every contributor on the leaderboard")
            _check_metrics(operator)
        finally:
            stop_all(runtimes, grace=20)
            down = subprocess.run(
                [*CLI, "deploy", "down", str(deploy_file)], capture_output=True, text=True, timeout=120
            )
        assert down.returncode == 0, down.stdout + down.stderr
        assert "[DEPLOY] stopped seed0, seed1, snapshot-server, auth" in down.stdout
        supervisor_log = tmp_path / "run" / "logs" / "deploy-operator.log"
        assert operator.pids() == [], f"left running on the operator's host; see {supervisor_log}"
        assert "[DEPLOY] stopped\n" in supervisor_log.read_text()  # the supervisor stopped every role itself
        assert [runtime.proc.returncode for runtime in runtimes] == [0] * len(runtimes), [r.log_path for r in runtimes]
        assert not (tmp_path / "run" / "deploy-operator.json").exists()
