"""The front-end core (agora_client.frontend): no Textual in it, one stream reader, one exit-code table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agora_client.events import AuthEvent, ErrorEvent, ExitEvent
from agora_client.frontend import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_REJECTED, EXIT_USAGE, client_exit_code
from agora_client.frontend.lines import LineFormatter
from agora_client.frontend.stream import TracebackFolder
from agora_client.swarm.demo import client_arguments, prune_runs

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

_IMPORT_PACKAGES = """
import importlib, pkgutil, sys
packages, watched = sys.argv[1].split(","), sys.argv[2].split(",")
for package in ["agora_cli", *packages]:
    importlib.import_module(package)
names = [m.name for package in packages for m in pkgutil.walk_packages(sys.modules[package].__path__, package + ".")]
for name in names:
    importlib.import_module(name)
print(len(names), sorted({m.split(".")[0] for m in sys.modules} & set(watched)))
"""


def imported_by(packages: tuple[str, ...], watched: tuple[str, ...]) -> tuple[int, str]:
    """In a fresh interpreter, import agora_cli and every submodule of ``packages``: (submodules imported,
    which of the ``watched`` top-level modules got loaded)."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PACKAGES, ",".join(packages), ",".join(watched)],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.split(" ", 1)
    return int(count), loaded.strip()


def test_importing_agora_client_and_every_submodule_never_imports_tui_or_textual():
    count, loaded = imported_by(("agora_client",), ("tui", "textual"))
    assert count > 50  # every module was imported, not just the package
    assert loaded == "[]"


def test_the_app_process_never_imports_torch_or_hivemind():
    # the first screen is up in the time textual takes; torch is loaded once, by the runtime it starts
    count, loaded = imported_by(("tui", "agora_client.frontend"), ("torch", "hivemind", "numpy"))
    assert count > 10
    assert loaded == "[]"


@pytest.mark.parametrize(
    ("runtime_code", "stop_signal", "rejected", "expected"),
    [
        (0, None, False, EXIT_OK),
        (1, None, False, EXIT_ERROR),
        (-9, None, False, EXIT_ERROR),
        (2, None, False, EXIT_USAGE),
        (3, None, False, EXIT_REJECTED),
        (1, None, True, EXIT_REJECTED),
        (0, signal.SIGINT, False, EXIT_INTERRUPTED),
        (1, signal.SIGTERM, False, EXIT_OK),
    ],
)
def test_one_exit_code_table(runtime_code, stop_signal, rejected, expected):
    assert client_exit_code(runtime_code, stop_signal, rejected) == expected


def test_a_traceback_becomes_one_line_and_the_log_keeps_it_whole():
    folder = TracebackFolder()
    lines = [
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/site-packages/hivemind/averaging/averager.py", line 500, in _step',
        "    raise AllreduceException('could not find a group')",
        "hivemind.averaging.allreduce.AllreduceException: could not find a group",
        "",
        "plain line",
    ]
    out = [folded for line in lines for folded in folder.feed(line)]
    assert out == [
        ("hivemind.averaging.allreduce.AllreduceException: could not find a group", "\n".join(lines[:4])),
        ("plain line", ""),
    ]
    folder.feed("Traceback (most recent call last):")
    folder.feed('  File "x.py", line 1, in <module>')
    assert folder.flush() == [
        ('File "x.py", line 1, in <module>', 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>')
    ]
    assert folder.flush() == []


STUCK_STOP_DUMP = [  # what faulthandler's watchdog writes for a stop that hangs (system/lifetime.py)
    "Timeout (0:00:08)!",
    "Thread 0x00007f6153ede6c0 (most recent call first):",
    '  File "/work/agora_client/system/lifetime.py", line 96 in _run',
    '  File "/usr/lib/python3.11/threading.py", line 982 in run',
    "",
    "Thread 0x00007f615621bb80 (most recent call first):",
    '  File "/usr/lib/python3.11/threading.py", line 327 in wait',
    '  File "/work/agora_client/averaging/sparta.py", line 539 in shutdown',
]


def test_a_stuck_stops_stack_dump_becomes_one_line_and_the_log_keeps_it_whole():
    folder = TracebackFolder()
    out = [folded for line in [*STUCK_STOP_DUMP, "", "[WORKER] stopped"] for folded in folder.feed(line)]
    shown = "the stop was still under way after 0:00:08: the stacks of its 2 threads are in the log"
    assert out == [(shown, "\n".join(STUCK_STOP_DUMP)), ("[WORKER] stopped", "")]
    for line in STUCK_STOP_DUMP:  # the process killed right after its dump: the end of the stream ends it
        assert folder.feed(line) == []
    assert folder.flush() == [(shown, "\n".join(STUCK_STOP_DUMP))]


def test_a_failure_is_said_once():
    formatter = LineFormatter()
    lines = [
        *formatter.format(AuthEvent(status="failed", message="could not reach the auth service at http://x")),
        *formatter.format(ExitEvent(code=1, reason="could not reach the auth service at http://x")),
    ]
    assert [line.render() for line in lines] == [
        "[ERROR] Authorization failed: could not reach the auth service at http://x"
    ]
    fresh = LineFormatter()
    assert [line.render() for line in fresh.format(ExitEvent(code=1, reason="killed"))] == [
        "[ERROR] The runtime exited with code 1: killed"
    ]
    fresh.format(ErrorEvent(message="boom"))
    assert fresh.format(ExitEvent(code=1, reason="boom")) == []


def test_cli_without_a_front_end_says_so(capsys, monkeypatch, tmp_path):
    from agora_client.cli import main

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    code = main(["--runtime-cmd", "true", "--config-dir", str(tmp_path)])
    assert code == 2
    assert "no front end" in capsys.readouterr().err


def test_demo_keeps_only_the_newest_runs(tmp_path):
    names = ["20260101-000000", "20260102-000000", "20260103-000000", "20260104-000000"]
    for name in names:
        (tmp_path / name / "client").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    removed = prune_runs(tmp_path, 2)
    assert [path.name for path in removed] == names[:2]
    assert sorted(path.name for path in tmp_path.iterdir()) == [*names[2:], "notes"]


def test_the_demo_joins_with_every_client_option_set(tmp_path):
    import argparse

    from agora_client.frontend.client import DEFAULT_RETRY_EVERY_S, configure

    every = argparse.ArgumentParser()
    configure(every)
    args = client_arguments(True, "http://127.0.0.1:1", "http://127.0.0.1:2", tmp_path / "client")
    assert vars(args).keys() == vars(every.parse_args([])).keys()  # an option added to the client reaches the demo
    assert (args.headless, args.swarm, args.monitor, args.config_dir) == (
        True,
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        tmp_path / "client",
    )
    assert (args.host_port, args.retry_every, args.gpu) == (0, DEFAULT_RETRY_EVERY_S, None)


def test_retry_every_reaches_the_runtime_with_a_default(monkeypatch, tmp_path):
    from agora_client.cli import build_parser
    from agora_client.frontend.client import DEFAULT_RETRY_EVERY_S, prepare
    from agora_client.frontend.supervisor import runtime_command

    def runtime_argv(*flags: str) -> tuple[str, ...]:
        args = build_parser().parse_args(
            # --allow-write-token: no Hugging Face here to ask what the token may do (test_token_scope.py)
            [
                "--headless",
                "--swarm",
                "http://127.0.0.1:9",
                "--config-dir",
                str(tmp_path),
                "--allow-write-token",
                *flags,
            ]
        )
        session = prepare(args)
        assert not isinstance(session, int)
        return session.command.argv

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    argv = runtime_argv("--retry-every", "5")
    assert argv[argv.index("runtime") :][-2:] == ("--retry-every", "5.0")
    argv = runtime_argv()
    assert argv[argv.index("--retry-every") + 1] == repr(DEFAULT_RETRY_EVERY_S)
    assert (
        "--retry-every" not in runtime_command(token="hf_abcdefghijkl", swarm="http://x").argv
    )  # the runtime's own default
    for bad in ("0", "-3", "soon", "nan"):
        with pytest.raises(SystemExit) as caught:
            build_parser().parse_args(["--retry-every", bad])
        assert caught.value.code == 2


def test_a_daemon_holding_the_runtimes_pipes_delays_neither_a_stop_nor_the_end_of_the_stream():
    """asyncio's Process.wait() also waits for the pipes; a daemon the runtime left in its group (p2pd,
    here a stand-in that ignores SIGINT) keeps them open. Neither the stop nor the reader may wait on it."""
    import asyncio
    import time

    import psutil

    from agora_client.frontend.supervisor import INTERRUPT_TIMEOUT_S, ChildCommand, RuntimeProcess

    fixture = str(ROOT / "tests" / "fixtures" / "events" / "sync1.jsonl")
    replay = (sys.executable, "-m", "agora_client.frontend.replay", fixture, "--spawn-grandchild")
    env = {"PYTHONPATH": str(ROOT)}

    async def leftovers_of(process: RuntimeProcess) -> list[psutil.Process]:
        deadline = time.monotonic() + 30
        while not psutil.Process(process.pid).children():
            assert time.monotonic() < deadline, "the stand-in did not start its daemon"
            await asyncio.sleep(0.05)
        return psutil.Process(process.pid).children()

    def gone(daemons: list[psutil.Process]) -> bool:
        return all(not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE for daemon in daemons)

    async def stopped() -> tuple[float, bool]:
        process = RuntimeProcess(ChildCommand((*replay, "--hold"), env))
        await process.start()
        reader = asyncio.create_task(asyncio.wait_for(_drain(process), 60))
        daemons = await leftovers_of(process)
        started = time.monotonic()
        try:
            await process.stop()
            await reader
        finally:
            await process.aclose()
        return time.monotonic() - started, gone(daemons)

    async def ended_by_itself() -> bool:
        process = RuntimeProcess(ChildCommand(replay, env))  # plays the file, exits 0, leaves its daemon behind
        await process.start()
        try:
            await asyncio.wait_for(_drain(process), 60)  # would never end while the daemon holds the pipes
            assert await asyncio.wait_for(process.wait(), 30) == 0
        finally:
            await process.aclose()
        return True

    seconds, daemons_gone = asyncio.run(stopped())
    assert seconds < INTERRUPT_TIMEOUT_S and daemons_gone
    assert asyncio.run(ended_by_itself())


async def _drain(process) -> int:
    count = 0
    async for _ in process.lines():
        count += 1
    return count
