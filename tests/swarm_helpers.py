"""Helpers for integration tests that run a real local swarm."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable, Iterable

PROGRESS = re.compile(r"\[PROGRESS\] microbatches=(\d+) loss=([0-9.]+)")


def progress(lines: list[str]) -> list[tuple[int, float]]:
    """(microbatches done, mean loss) of every progress line a trainer printed."""
    return [(int(m.group(1)), float(m.group(2))) for line in lines if (m := PROGRESS.search(line))]


def json_events(lines: Iterable[str]) -> list[dict]:
    """The JSON objects among output lines (log lines, and a line still being written, are skipped)."""
    found = []
    for line in lines:
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def events(path: Path) -> list[dict]:
    return json_events(path.read_text().splitlines()) if path.exists() else []


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
