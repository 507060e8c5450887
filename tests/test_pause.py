"""`agora pause` / `agora resume` from another terminal (issue 48): the control socket's answers, its permissions,
bad input, a socket a killed runtime left, and the commands against a real runtime process.

The real runtime reads its run description from a real auth service and is held before its join by
``--active-hours`` that exclude now, so the pause is seen in its yield events within seconds, without a swarm; the
drain of a serving worker is the yield control's (tests/test_gpu_yield.py)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    write_demo_token_file,
)
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.config import load_config
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.events import json_objects
from agora_client.system.gpu_yield import PAUSED_REASON, YieldPolicy
from agora_client.system.pause_cli import control
from agora_client.system.pause_control import PauseControlError, PauseServer, send, socket_path

ROOT = Path(__file__).resolve().parent.parent
UNDIALED_SEED = (
    "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # held before the join: unused
)


def agora(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "agora_cli.py"), *argv], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def server(tmp_path: Path):
    policy = YieldPolicy("never")
    control = PauseServer(tmp_path / "client", None, policy)
    control.start()
    yield control
    control.close()


def test_the_socket_is_the_owners_alone_and_answers_each_command(server: PauseServer) -> None:
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.path.parent.stat().st_mode) == 0o700
    assert send(server.path, "pause").changed and server.policy.paused
    again = send(server.path, "pause")
    assert again.ok and not again.changed and again.message == "already paused"
    assert send(server.path, "resume").changed and not server.policy.paused
    assert send(server.path, "resume").message == "not paused"


def test_bad_input_gets_an_error_and_the_control_keeps_answering(server: PauseServer) -> None:
    wrong = send(server.path, "shutdown")
    assert not wrong.ok and "unknown command 'shutdown'" in wrong.message
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as rude:  # a line longer than any command, never ended
        rude.connect(str(server.path))
        rude.sendall(b"x" * 10_000)
    assert send(server.path, "pause").ok and server.policy.paused


def test_a_socket_left_by_a_killed_runtime_is_taken_over_and_a_live_one_is_not(tmp_path: Path) -> None:
    path = socket_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: what a SIGKILL leaves
    assert send(path, "pause") is None
    first = PauseServer(tmp_path, 0, YieldPolicy("never"))
    first.start()
    try:
        with pytest.raises(PauseControlError, match="another runtime"):
            PauseServer(tmp_path, 0, YieldPolicy("never")).start()
        assert send(path, "pause").changed
    finally:
        first.close()
    assert not path.exists()


def test_no_runtime_running_is_said_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = agora("pause", "--config-dir", str(tmp_path))
    assert done.returncode == 1
    assert f"no runtime is running with config dir {tmp_path}" in done.stderr
    assert control(argparse.Namespace(config_dir=tmp_path, gpu=3, cpu=False), "resume") == 1
    assert "no runtime is running on gpu3" in capsys.readouterr().err


def _hours_excluding_now() -> str:
    hour = datetime.now().hour
    return f"{(hour + 2) % 24:02d}-{(hour + 3) % 24:02d}"  # an hour's margin either side of now


class _Events:
    """The runtime's JSON events, read from its stdout on a thread."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)
        self._thread.start()

    def yields(self) -> list[dict]:
        return [event for event in json_objects(list(self.lines)) if event.get("kind") == "yield"]

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition(self.yields()):
            assert time.monotonic() < deadline and self.process.poll() is None, f"no {what} in {self.lines}"
            time.sleep(0.2)


def _auth_server(tmp_path: Path) -> tuple[AuthServer, str]:
    config = load_config("tiny")
    tokenizer = load_run_tokenizer(config)
    token = write_demo_token_file(tmp_path / "tokens.json", "alice")
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=tuple(config.model.stage_names), pacing_s=0.0),
        tokenizer_json=tokenizer.content,
        run=describe_run(config, (UNDIALED_SEED,), None, None, TokenizerSummary.of(tokenizer)),
    )
    return AuthServer(AuthService(settings, TokenFileIdentity(tmp_path / "tokens.json"), tmp_path / "state")), token


@pytest.mark.timeout(300)
def test_pause_and_resume_reach_a_real_runtime(tmp_path: Path) -> None:
    config_dir = tmp_path / "client"
    auth, token = _auth_server(tmp_path)
    with auth:
        runtime = subprocess.Popen(
            [sys.executable, str(ROOT / "agora_cli.py"), "runtime", "--swarm", auth.url, "--cpu"]
            + ["--config-dir", str(config_dir), "--yield", "never", "--active-hours", _hours_excluding_now()],
            env={**os.environ, "HF_TOKEN": token, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            events = _Events(runtime)
            events.wait_for(lambda seen: any("outside active hours" in e["reason"] for e in seen), "held before join")
            paused = agora("pause", "--config-dir", str(config_dir))
            assert (
                paused.returncode == 0
                and paused.stdout == "cpu: paused: the worker finishes what it serves and drains\n"
            )
            events.wait_for(lambda seen: any(e["reason"].startswith(PAUSED_REASON) for e in seen), "pause event")
            again = agora("pause", "--config-dir", str(config_dir), "--cpu")
            assert again.returncode == 0 and again.stdout == "cpu: already paused\n"
            resumed = agora("resume", "--config-dir", str(config_dir))
            assert resumed.returncode == 0 and "cpu: resumed" in resumed.stdout
            events.wait_for(lambda seen: "outside active hours" in seen[-1]["reason"], "the policy's own reason back")
            runtime.send_signal(signal.SIGINT)
            assert runtime.wait(timeout=60) == 0
        finally:
            if runtime.poll() is None:
                runtime.kill()
                runtime.wait()
    assert not socket_path(config_dir, None).exists()  # the runtime removed its socket on the way out
