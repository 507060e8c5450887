"""--restart on-failure and --notify-cmd with real processes: the front end's supervisor restarts a runtime stand-in
(agora_client.frontend.replay) that was SIGKILLed or crashed, never one it stopped itself, gives up by the rule,
and runs a real notify command once per kind of event without the token. Plus the SPARTA line of a recorded round."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from agora_client.events import parse_event
from agora_client.frontend.exit_codes import EXIT_ERROR, EXIT_OK, EXIT_REJECTED
from agora_client.frontend.headless import HeadlessPrinter, run_headless
from agora_client.frontend.lines import LineFormatter
from agora_client.frontend.notify import Notifier
from agora_client.frontend.restart import RestartPolicy
from agora_client.frontend.supervisor import ChildCommand
from tests.replays import FIXTURES, ROOT, make_app, until
from tui.widgets import LogPane

pytestmark = pytest.mark.timeout(60)
TOKEN = "hf_restartNotifySecret13579"
# The notify command: appends its message (last argument), kind and whether it saw the token to a file.
RECORDER = (
    "import json, os, sys; open(os.environ['NOTIFY_FILE'], 'a').write(json.dumps({'message': sys.argv[-1], "
    "'kind': os.environ['AGORA_NOTIFY_KIND'], 'env_message': os.environ['AGORA_NOTIFY_MESSAGE'], "
    "'token_in_env': any(%r in value for value in os.environ.values())}) + '\\n')" % TOKEN
)


def replay_argv(fixture: Path, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "agora_client.frontend.replay", str(fixture), *args)


def runtimes_of(pid: int) -> list[psutil.Process]:
    """The runtime stand-ins a front end (or this test process) has started."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if "agora_client.frontend.replay" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def wait_for_runtime(pid: int, other_than: int | None = None, timeout: float = 30.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = [child for child in runtimes_of(pid) if child.pid != other_than]
        if fresh:
            return fresh[0]
        time.sleep(0.05)
    raise AssertionError("no runtime was started")


class OutputLines:
    """The client's stdout, read line by line on a thread, so that a test can wait for a line before it signals."""

    def __init__(self, client: subprocess.Popen):
        self.lines: list[str] = []
        self.errors: list[str] = []  # stderr, drained so that the client never blocks writing it
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(client.stdout,), daemon=True)
        self._reader.start()
        threading.Thread(target=lambda: self.errors.extend(client.stderr), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = 30.0) -> None:
        """Until ``count`` lines hold ``text``."""
        with self._changed:
            if not self._changed.wait_for(lambda: sum(text in line for line in self.lines) >= count, timeout):
                raise AssertionError(f"not {count} lines with {text!r} in {timeout:.0f}s: {self.lines}")

    def rest(self, timeout: float = 30.0) -> str:
        """Everything the client printed, once its stdout closed."""
        self._reader.join(timeout)
        return "\n".join(self.lines)


# The stand-in's first line: it printed it after setting its own SIGINT disposition (replay.main).
STAND_IN_READY = "Agora client 0.1.0"


def headless(tmp_path: Path, *flags: str, replay_args: tuple[str, ...] = ()) -> subprocess.Popen:
    runtime = shlex.join(replay_argv(FIXTURES / "sync1.jsonl", "--hold", *replay_args))
    argv = [
        sys.executable,
        str(ROOT / "agora_cli.py"),
        "--headless",
        "--config-dir",
        str(tmp_path / "config"),
        "--runtime-cmd",
        runtime,
        *flags,
    ]
    env = {**os.environ, "HF_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )


def test_a_runtime_killed_with_sigkill_is_restarted_after_the_backoff_and_sigterm_then_stops_it(tmp_path):
    client = headless(tmp_path, "--restart", "on-failure")
    output = OutputLines(client)
    try:
        first = wait_for_runtime(client.pid)
        command = first.cmdline()
        output.wait_for(STAND_IN_READY)
        killed_at = time.monotonic()
        first.send_signal(signal.SIGKILL)
        second = wait_for_runtime(client.pid, other_than=first.pid, timeout=20)
        waited = time.monotonic() - killed_at
        assert second.cmdline() == command  # the same command: the same token, config dir and identity
        output.wait_for(STAND_IN_READY, count=2)
        client.send_signal(signal.SIGTERM)
        client.wait(timeout=30)
        out = output.rest()
    finally:
        if client.poll() is None:
            client.kill()
    assert 5.0 <= waited < 15.0, waited  # the first delay of the documented backoff
    assert client.returncode == EXIT_OK
    restarts = [line for line in out.splitlines() if line.startswith("[RESTART]")]
    assert restarts == [
        "[RESTART] The worker runtime crashed (killed by SIGKILL); starting it again with the same identity in 5s "
        "(crash 1; giving up at 6 within 30 minutes)"
    ]
    assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE


def test_ctrl_c_is_never_restarted_even_when_the_runtime_dies_of_the_stop(tmp_path):  # SIGTERM: the test above
    # The stand-in ignores SIGINT: the second Ctrl-C gives it SIGTERM, which kills it, as a crash would.
    client = headless(tmp_path, "--restart", "on-failure", replay_args=("--ignore-sigint",))
    output = OutputLines(client)
    try:
        runtime = wait_for_runtime(client.pid)
        output.wait_for(STAND_IN_READY)
        client.send_signal(signal.SIGINT)
        output.wait_for("Interrupted: stopping the worker")
        client.send_signal(signal.SIGINT)
        client.wait(timeout=30)
        out = output.rest()
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 130
    assert "[RESTART]" not in out
    assert not runtime.is_running() or runtime.status() == psutil.STATUS_ZOMBIE


def test_restarts_double_their_wait_and_give_up_with_the_last_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("NOTIFY_FILE", str(tmp_path / "notes.jsonl"))
    out = io.StringIO()
    policy = RestartPolicy("on-failure", limit=3, window_s=60.0, base_s=0.2, cap_s=0.3)
    command = ChildCommand(replay_argv(FIXTURES / "crash.jsonl", "--exit-code", "1"), {"PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    code = asyncio.run(
        run_headless(
            command,
            HeadlessPrinter(out),
            err=io.StringIO(),
            restart=policy,
            notify_cmd=(sys.executable, "-c", RECORDER),
            secrets=(TOKEN,),
        )
    )
    assert code == EXIT_ERROR
    assert time.monotonic() - started >= 0.5  # 0.2s, then 0.3s (0.4s capped)
    lines = out.getvalue().splitlines()
    last_error = "exit code 1: CUDA out of memory while running backward (tried to allocate 2.0 GB)"
    assert [line for line in lines if line.startswith("[RESTART]")] == [
        f"[RESTART] The worker runtime crashed ({last_error}); starting it again with the same identity in 0.2s "
        "(crash 1; giving up at 3 within 1 minutes)",
        f"[RESTART] The worker runtime crashed ({last_error}); starting it again with the same identity in 0.3s "
        "(crash 2; giving up at 3 within 1 minutes)",
    ]
    assert (
        lines[-1] == "[ERROR] The worker runtime crashed 3 times within 1 minutes; not starting it again. "
        f"Last error: {last_error}"
    )
    notes = [json.loads(line) for line in (tmp_path / "notes.jsonl").read_text().splitlines()]
    # each run ran out of memory once (its error event) and dropped out once; the last says it gave up
    assert sorted(note["kind"] for note in notes) == ["dropped"] * 3 + ["out_of_memory"] * 3
    dropped = [note["message"].split(": ", 1)[1] for note in notes if note["kind"] == "dropped"]
    assert sorted(dropped) == sorted(
        [
            f"the worker runtime dropped out ({last_error}); starting again in 0.2s",
            f"the worker runtime dropped out ({last_error}); starting again in 0.3s",
            f"the worker runtime dropped out ({last_error}); giving up",
        ]
    )


def test_the_give_up_rule_counts_crashes_within_the_window_only():
    now = [0.0]
    policy = RestartPolicy("on-failure", limit=3, window_s=600.0, base_s=5.0, cap_s=8.0, clock=lambda: now[0])
    delays = []
    for at in (0.0, 10.0, 700.0, 705.0):  # the first two fall out of the window before the third and fourth
        now[0] = at
        delays.append(policy.after_end(-9, "killed by SIGKILL").delay_s)
    assert delays == [5.0, 8.0, 5.0, 8.0]  # the wait doubles with the crashes in the window, capped
    now[0] = 706.0
    assert policy.after_end(1, "exit code 1").gives_up  # three within ten minutes
    assert (
        policy.after_end(3, "rejected") is None and policy.after_end(2, "bad config") is None
    )  # a restart repeats them
    assert RestartPolicy("never").after_end(-9, "killed by SIGKILL") is None


def write_stream(path: Path, *events: dict) -> Path:
    path.write_text(
        "".join(json.dumps({"v": 1, "ts": 1767225600.0 + index, **event}) + "\n" for index, event in enumerate(events))
    )
    return path


def test_the_notify_command_runs_once_per_event_kind_without_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("NOTIFY_FILE", str(tmp_path / "notes.jsonl"))
    oom = {"kind": "error", "message": f"CUDA out of memory (HF_TOKEN={TOKEN})", "hint": "", "where": "worker"}
    active = {"kind": "sync", "phase": "active", "steps_left": 0, "steps_total": 10, "local_epoch": 70, "message": ""}
    stream = write_stream(
        tmp_path / "stream.jsonl",
        {"kind": "auth", "status": "authorized", "identity": "alice", "stage": "body1", "slot": 7, "message": ""},
        active,
        active,
        oom,
        oom,
        {"kind": "exit", "code": 1, "reason": "unrecoverable error"},
    )
    code = asyncio.run(
        run_headless(
            ChildCommand(replay_argv(stream, "--exit-code", "1"), {"PYTHONPATH": str(ROOT)}),
            HeadlessPrinter(io.StringIO()),
            err=io.StringIO(),
            notify_cmd=(sys.executable, "-c", RECORDER),
            secrets=(TOKEN,),
        )
    )
    assert code == EXIT_ERROR
    notes = [json.loads(line) for line in (tmp_path / "notes.jsonl").read_text().splitlines()]
    assert sorted(note["kind"] for note in notes) == ["active", "dropped", "out_of_memory"]
    by_kind = {note["kind"]: note for note in notes}
    assert by_kind["active"]["message"].endswith("the worker left the queue and is Active on stage body1")
    assert "CUDA out of memory" in by_kind["out_of_memory"]["message"]
    for note in notes:
        assert TOKEN not in note["message"] and note["message"] == note["env_message"] and not note["token_in_env"]

    refused = asyncio.run(
        run_headless(
            ChildCommand(replay_argv(FIXTURES / "rejected.jsonl", "--exit-code", "3"), {"PYTHONPATH": str(ROOT)}),
            HeadlessPrinter(io.StringIO()),
            err=io.StringIO(),
            notify_cmd=(sys.executable, "-c", RECORDER),
            secrets=(TOKEN,),
            restart=RestartPolicy("on-failure"),
        )
    )
    assert refused == EXIT_REJECTED  # a refusal is no crash: not restarted, and said once, as a refusal
    notes = [json.loads(line) for line in (tmp_path / "notes.jsonl").read_text().splitlines()][3:]
    assert [note["kind"] for note in notes] == ["refused"] and "the swarm is full" in notes[0]["message"]


async def test_a_failing_or_slow_notify_command_costs_one_line_and_never_blocks():
    said: list[str] = []
    slow = Notifier((sys.executable, "-c", "import time; time.sleep(30)"), report=said.append, timeout_s=0.5)
    failing = Notifier((sys.executable, "-c", "import sys; sys.exit('no route to ntfy.sh')"), report=said.append)
    missing = Notifier(("/nonexistent/notify-tool",), report=said.append)
    started = time.monotonic()
    for notifier in (slow, failing, missing):
        notifier.runtime_ended(-9, "killed by SIGKILL")
    assert time.monotonic() - started < 0.2  # sent in the background
    for notifier in (failing, missing, slow):
        await notifier.aclose()
    assert sorted(said) == sorted(
        [
            f"Notification (dropped) not sent: {sys.executable} took longer than 0.5s; stopped it",
            f"Notification (dropped) not sent: {sys.executable} ended with exit code 1: no route to ntfy.sh",
            "Notification (dropped) not sent: could not run /nonexistent/notify-tool: No such file or directory",
        ]
    )
    assert not [child for child in psutil.Process().children() if "time.sleep(30)" in " ".join(child.cmdline())]


async def test_the_app_restarts_a_crashed_runtime_by_itself_and_q_during_the_wait_ends_it():
    # --delay: each run lasts about a second, time enough to lengthen the next wait before the second crash
    app = make_app(
        "crash", "--exit-code", "1", "--delay", "0.02", restart=RestartPolicy("on-failure", base_s=0.2, limit=5)
    )
    async with app.run_test(size=(100, 34)) as pilot:
        await until(pilot, lambda: app.process is not None and app.process.pid)
        first = app.process.pid
        await until(pilot, lambda: app.process.pid != first)  # no key pressed: --restart did it
        log = "\n".join(app.query_one(LogPane).plain_lines())
        assert "[RESTART] The worker runtime crashed (exit code 1: CUDA out of memory while running backward" in log
        app.restart_policy.base_s = 30.0  # the next wait is long: q must end it at once, with no restart
        await until(pilot, lambda: app.restart_timer is not None and not app.runtime_running)
        waiting = app.process.pid
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running)
    assert app.process.pid == waiting and app.return_code == EXIT_ERROR


def test_the_sparta_line_says_what_share_of_the_stage_a_recorded_round_averaged():
    recorded = next(line for line in (FIXTURES / "active.jsonl").read_text().splitlines() if '"round":10,' in line)
    (line,) = LineFormatter().format(parse_event(recorded))
    assert line.render() == "[SPARTA] Round 10: averaged partition 10 of 20 (5% of the stage) in a group of 3 in 1.1s"
    partial = parse_event({**json.loads(recorded), "fraction": 0.8, "partitions": 64, "stage_share": 1 / 64})
    assert "averaged 80% of partition 10 of 64 (1.25% of the stage)" in LineFormatter().format(partial)[0].text
    older = {key: value for key, value in json.loads(recorded).items() if key not in ("partitions", "stage_share")}
    assert "averaged partition 10 in a group of 3" in LineFormatter().format(parse_event(older))[0].text
