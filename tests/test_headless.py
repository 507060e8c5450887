"""Headless client: tagged lines for recorded streams, exit codes, Ctrl-C, JSON lines, logs."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agora_client.events import PointsEvent, SyncEvent
from agora_client.frontend.lines import LineFormatter
from agora_client.frontend.supervisor import INTERRUPT_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "events"
TOKEN = "hf_headlessSecret98765"

pytestmark = pytest.mark.timeout(60)


def client(tmp_path: Path, fixture: str, *replay_args: str, log_format: str = "text") -> list[str]:
    runtime = shlex.join(
        [sys.executable, "-m", "agora_client.frontend.replay", str(FIXTURES / f"{fixture}.jsonl"), *replay_args]
    )
    return [
        sys.executable,
        str(ROOT / "agora_cli.py"),
        "--headless",
        "--log-format",
        log_format,
        "--config-dir",
        str(tmp_path / "config"),
        "--runtime-cmd",
        runtime,
    ]


def run_client(
    tmp_path: Path, fixture: str, *replay_args: str, log_format: str = "text"
) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        client(tmp_path, fixture, *replay_args, log_format=log_format),
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )


def test_recorded_stream_prints_the_golden_tagged_lines(tmp_path):
    result = run_client(tmp_path, "active")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (FIXTURES / "active.headless.txt").read_text()


def test_the_points_line_gives_verified_compute_of_claimed_and_says_when_the_claim_exceeds_the_receipts():
    flagged = PointsEvent(
        presence=1.0, compute=40.0, confirmed=5.0, claimed_compute=40.0, verified_compute=4.0, flagged=True
    )
    assert [line.render() for line in LineFormatter().format(flagged)] == [
        "[POINTS] Presence 1.0, compute 40.0, 0.0 per hour, confirmed 5.0; compute verified 4.0 of 40.0 claimed "
        "(the claim exceeds the trainers' receipts: only receipted compute earns points)"
    ]
    assert [line.render() for line in LineFormatter().format(PointsEvent(presence=1.0, compute=4.0))] == [
        "[POINTS] Presence 1.0, compute 4.0, 0.0 per hour"
    ]


def test_sync_lines_are_the_runtime_messages_exactly():
    lines = LineFormatter().format(
        SyncEvent(
            phase="sync2",
            steps_left=100,
            steps_total=100,
            target_epoch=7,
            message=(
                "Synchronising optimizer state. Node is now processing batches, but doesn't contribute to "
                "weight averaging yet.\n"
                "This phase will last 100 steps (until local epoch 7)."
            ),
        )
    )
    assert [line.render() for line in lines] == [
        "[SYNC] Synchronising optimizer state. Node is now processing batches, but doesn't contribute to "
        "weight averaging yet.",
        "[SYNC] This phase will last 100 steps (until local epoch 7).",
    ]
    assert LineFormatter().format(SyncEvent(phase="sync1", steps_left=3, steps_total=40)) == []


def test_exit_codes_for_rejection_and_crash(tmp_path):
    rejected = run_client(tmp_path, "rejected", "--exit-code", "3")
    assert rejected.returncode == 3
    assert "[ERROR] Authorization rejected by the swarm: the swarm is full" in rejected.stdout
    crashed = run_client(tmp_path, "crash", "--exit-code", "1", "--stderr", f"Traceback: token {TOKEN}")
    assert crashed.returncode == 1
    assert "[ERROR] What to do: Close other programs that use this GPU" in crashed.stdout
    assert "Traceback: token **REDACTED**" in crashed.stderr and TOKEN not in crashed.stderr


def test_json_lines_and_malformed_input(tmp_path):
    result = run_client(tmp_path, "malformed", log_format="json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [record["tag"] for record in records] == ["AUTH", "WARNING", "WARNING", "WARNING", "WARNING", "QUEUE"]
    assert records[-1]["event"]["position"] == 4 and records[1]["event"] is None


def test_bad_usage_exits_2_with_one_clear_line(tmp_path):
    env = {**os.environ, "HF_TOKEN": TOKEN}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "agora_cli.py"),
            "--headless",
            "--swarm",
            "ftp://nowhere",
            "--config-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("agora: --swarm 'ftp://nowhere' is not an http(s) URL")
    assert "Traceback" not in result.stderr


def test_ctrl_c_stops_the_child_gracefully_and_exits_130(tmp_path):
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        client(tmp_path, "sync1", "--hold", "--spawn-grandchild"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = psutil.Process(process.pid).children(recursive=True)
            if len(children) >= 2:
                break
            time.sleep(0.1)
        descendants = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
        assert len(descendants) >= 2  # the runtime stand-in and its daemon
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    assert "[SYNC] Synchronising weights with peers. Node won't process batches in this phase." in out
    assert out.rstrip().splitlines()[-1] == (
        "[INFO] Interrupted: stopping the worker (finishing the current request, freeing the slot)..."
    )  # and nothing but warnings or errors after it
    for pid in descendants:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_second_ctrl_c_stops_the_runtime_at_once(tmp_path):
    """The runtime stand-in ignores SIGINT: the first Ctrl-C would wait out the graceful stop's 10 s; the second
    gives the runtime its second stop signal at once."""
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        client(tmp_path, "sync1", "--hold", "--ignore-sigint"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert "[SYNC]" in _first_line_with(process, "[SYNC]", timeout=30)  # the runtime is up and replaying
        process.send_signal(signal.SIGINT)
        _first_line_with(process, "Interrupted: stopping the worker", timeout=30)
        process.send_signal(signal.SIGINT)
        hurried = time.monotonic()
        process.communicate(timeout=30)
        assert time.monotonic() - hurried < INTERRUPT_TIMEOUT_S  # not the graceful stop's wait
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130


def _first_line_with(process: subprocess.Popen, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if text in line:
            return line
        assert line or process.poll() is None, f"the client ended before printing {text!r}"
    raise AssertionError(f"no line with {text!r} within {timeout} s")


def test_events_are_logged_per_gpu_without_the_token(tmp_path):
    result = run_client(tmp_path, "crash", "--exit-code", "1", "--stderr", f"HF_TOKEN={TOKEN}")
    assert result.returncode == 1
    log = tmp_path / "config" / "logs" / "cpu.jsonl"  # no NVIDIA GPU on the test machine
    text = log.read_text()
    assert len(text.splitlines()) == len((FIXTURES / "crash.jsonl").read_text().splitlines()) + 1
    assert '"tag":"STDERR"' in text and TOKEN not in text


def test_the_runtime_stops_when_the_front_end_dies_without_stopping_it(tmp_path):
    """A closed terminal kills the front end (SIGHUP) before any cleanup: the runtime must not live on."""
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        client(tmp_path, "sync1", "--hold"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 40
        while not psutil.Process(process.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        runtime = psutil.Process(process.pid).children()[0]
        process.kill()
        process.wait(10)
        runtime.wait(10)  # raises TimeoutExpired if it lived on
    finally:
        if process.poll() is None:
            process.kill()


def test_retry_every_is_a_client_option_the_runtime_accepts(tmp_path):
    """The README's `--headless --retry-every 5`: the real runtime gets the flag (no usage error from either
    parser) and, with no swarm at the address, fails on that, once, with exit code 1."""
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "agora_cli.py"),
            "--headless",
            "--cpu",
            "--allow-write-token",  # no Hugging Face here to ask what the token may do (test_token_scope.py)
            "--retry-every",
            "5",
            "--swarm",
            "http://127.0.0.1:9",
            "--config-dir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "usage:" not in result.stderr and "unrecognized arguments" not in result.stderr
    assert result.stdout.count("[ERROR] could not read the run description at http://127.0.0.1:9/v1/run") == 1
