"""The state file of `agora deploy up` on one host: the supervisor's pid and each role's process group.

``<run dir>/deploy-<host>.json``, written whole (never half) after every change; `agora deploy down` reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

from .spec import DeploySpec


def state_path(spec: DeploySpec, host_name: str) -> Path:
    return spec.run.dir / f"deploy-{host_name}.json"


def write_state(path: Path, supervisor: int, roles: list[dict], ready: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(
        json.dumps({"supervisor": supervisor, "ready": ready, "roles": roles}, indent=1), encoding="utf-8"
    )
    os.replace(partial, path)


def read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def supervisor_alive(state: dict) -> bool:
    """Whether the state's supervisor still runs (and its pid was not taken by another program since)."""
    try:
        return "deploy" in psutil.Process(state["supervisor"]).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
