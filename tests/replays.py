"""Recorded event streams for the app's tests, replayed by a real child process (agora_client.frontend.replay)."""

from __future__ import annotations

import asyncio
import datetime
import sys
from pathlib import Path

from agora_client.frontend.supervisor import ChildCommand
from tui.app import AgoraApp

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "events"
T0 = 1767225600.0  # the app's fixed clock, so that its own lines and ETAs are the same on every run
SIZE = (100, 34)  # the Pilot tests' terminal


def replay(name: str, *args: str) -> ChildCommand:
    """The command that replays fixture ``name`` as a runtime would stream it."""
    argv = (sys.executable, "-m", "agora_client.frontend.replay", str(FIXTURES / f"{name}.jsonl"), *args)
    return ChildCommand(argv, {"PYTHONPATH": str(ROOT)})


def make_app(name: str, *args: str, **kwargs) -> AgoraApp:
    return AgoraApp(replay(name, *args), tz=datetime.timezone.utc, clock=lambda: T0, **kwargs)


def line_count(*names: str) -> int:
    return sum(len((FIXTURES / f"{name}.jsonl").read_text().splitlines()) for name in names)


async def until(pilot, condition, timeout: float = 45.0) -> None:
    """Let the app run until ``condition()`` holds (fails the test after ``timeout`` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await pilot.pause(0.05)
    await pilot.pause()
