"""Helpers for integration tests that run a real local swarm."""

from __future__ import annotations

import re
import time
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from agora_client.events import json_objects

PROGRESS = re.compile(r"\[PROGRESS\] microbatches=(\d+) loss=([0-9.]+)")


def progress(lines: list[str]) -> list[tuple[int, float]]:
    """(microbatches done, mean loss) of every progress line a trainer printed."""
    return [(int(m.group(1)), float(m.group(2))) for line in lines if (m := PROGRESS.search(line))]


def events(path: Path) -> list[dict]:
    return json_objects(path.read_text().splitlines()) if path.exists() else []


def wait_until(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)


def tiny_variant(path: Path, changes: dict[str, dict[str, Any]]) -> str:
    """The tiny preset with some fields of its sections changed, written to ``path``: the --preset to pass."""
    preset = yaml.safe_load((resources.files("agora_client") / "presets" / "tiny.yaml").read_text())
    for section, fields in changes.items():
        preset[section] = {**preset.get(section, {}), **fields}
    path.write_text(yaml.safe_dump(preset))
    return str(path)
