"""`agora deploy up` keeps a host's roles up as their systemd units would: a role that fails is started again alone,
after RestartSec, while the others keep running, and `agora deploy down` then stops the new one too; a role that
keeps failing stops the host, and one that exits 0 on its own is left stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from agora_client.auth.identity import write_demo_token_file
from agora_client.deploy.plan import Launch
from agora_client.deploy.state import read_state
from agora_client.swarm.processes import CLI, group_pids
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _deploy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "deploy", *args], capture_output=True, text=True, timeout=180)


def _roles(state_file: Path) -> dict[str, dict]:
    state = read_state(state_file) or {"roles": []}
    return {role["name"]: role for role in state["roles"]} if state.get("ready") else {}


def test_a_failed_role_is_started_again_alone_and_the_others_keep_running(tmp_path):
    port, auth_port = _free_port(), _free_port()
    write_demo_token_file(tmp_path / "secrets" / "tokens.json", "alice")
    spec = {
        "run": {"config": "tiny2", "dir": str(tmp_path / "run")},
        "secrets": str(tmp_path / "secrets"),
        "stores": {"snapshots": str(tmp_path / "snapshots")},
        "hosts": {
            "operator": {
                "address": "127.0.0.1",
                "roles": {
                    "seeds": {"count": 1},
                    "snapshot_server": {"port": port},
                    "auth": {"port": auth_port, "identity": "token-file", "token_file": "secrets/tokens.json"},
                },
            }
        },
    }
    deploy_file = tmp_path / "deploy.yaml"
    deploy_file.write_text(yaml.safe_dump(spec))
    state_file = tmp_path / "run" / "deploy-operator.json"
    supervisor_log = tmp_path / "run" / "logs" / "deploy-operator.log"
    up = _deploy("up", str(deploy_file), "--detach")
    pgids: list[int] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        before = _roles(state_file)
        pgids += [role["pgid"] for role in before.values()]
        os.killpg(before["snapshot-server"]["pgid"], signal.SIGKILL)  # a crash of the role and all it started
        wait_until(
            lambda: (
                _roles(state_file).get("snapshot-server", before["snapshot-server"])["pgid"]
                != before["snapshot-server"]["pgid"]
            ),
            120,
            "the snapshot server to be started again",
        )
        after = _roles(state_file)
        pgids.append(after["snapshot-server"]["pgid"])
        for kept in ("seed0", "auth"):
            assert after[kept]["pgid"] == before[kept]["pgid"] and group_pids(before[kept]["pgid"]), kept
        assert httpx.get(f"http://127.0.0.1:{port}/head/latest.json", timeout=10).status_code == 404  # serving
        said = supervisor_log.read_text()
        assert "[ERROR] snapshot-server exited with -9" in said and "[DEPLOY] starting snapshot-server again" in said
        assert f"[DEPLOY] snapshot-server ready again: http://127.0.0.1:{port}" in said
    finally:
        down = _deploy("down", str(deploy_file))
    assert down.returncode == 0, down.stdout + down.stderr
    assert [pid for pgid in pgids for pid in group_pids(pgid)] == []
    assert "[DEPLOY] stopped\n" in supervisor_log.read_text()


def test_a_role_that_keeps_failing_stops_the_host_and_one_that_exits_0_is_left_stopped(tmp_path, monkeypatch, capsys):
    """The supervisor's watch with real processes standing in for roles: one prints its ready line and fails at
    once, every time; another exits 0 after its ready line."""
    from types import SimpleNamespace

    from agora_client.deploy import supervisor
    from agora_client.swarm.processes import ManagedProcess

    def start(spec, launch):
        code = {"crashing": 1, "finishing": 0}[launch.name]
        program = [sys.executable, "-c", f"print('READY', flush=True); import time; time.sleep(0.5); exit({code})"]
        return ManagedProcess(launch.name, [], tmp_path / f"{launch.name}.log", program=program)

    monkeypatch.setattr(supervisor, "_start", start)
    monkeypatch.setattr(supervisor, "RESTART_AFTER_S", 0.0)
    launches = [Launch(name, (), "READY", f"{name}:1") for name in ("crashing", "finishing")]
    spec = SimpleNamespace(run=SimpleNamespace(dir=tmp_path))
    processes = [start(spec, launch) for launch in launches]
    roles = [{"name": launch.name, "pgid": process.pgid} for launch, process in zip(launches, processes, strict=True)]
    try:
        assert supervisor._watch(spec, launches, processes, roles, tmp_path / "state.json") == 1
    finally:
        for process in processes:
            process.stop(grace=5)
    said = capsys.readouterr().out
    assert said.count("[ERROR] crashing exited with 1") == supervisor.CRASH_LOOP_LIMIT
    assert said.count("[DEPLOY] crashing ready again") == supervisor.CRASH_LOOP_LIMIT - 1
    assert f"[ERROR] crashing failed {supervisor.CRASH_LOOP_LIMIT} times within 600 s: stopping the host" in said
    assert said.count("[DEPLOY] finishing exited on its own (0): not started again") == 1
    assert read_state(tmp_path / "state.json")["roles"][0]["pgid"] == processes[0].pgid  # the latest start
