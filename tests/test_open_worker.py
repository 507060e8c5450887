"""A worker without the auth service's key serves and averages with anyone: it starts only when told ``--open``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agora_client.swarm.roles import worker_args

REPO = Path(__file__).resolve().parents[1]
UNREACHABLE_SEED = "/ip4/127.0.0.1/tcp/1"


def start_worker(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "agora_cli.py"), "worker", "--stage", "head", "--seeds", UNREACHABLE_SEED, *flags],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_gaming_keyless_worker_without_open(tmp_path: Path):
    refused = start_worker(tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "--auth-public-key" in refused.stderr and "--open" in refused.stderr
    assert "Traceback" not in refused.stderr
    opened = start_worker(tmp_path, "--open")  # goes on, and stops only where no seed answers
    assert opened.returncode == 1 and "seed" in opened.stderr, opened.stderr


def test_the_local_swarm_opens_its_keyless_workers_and_only_those(tmp_path: Path):
    common = dict(stage="head", index=0, preset="tiny", host="127.0.0.1", seeds=["s"], events=tmp_path / "e.jsonl")
    assert "--open" in worker_args(ticket_key=None, **common)
    keyed = worker_args(ticket_key=tmp_path / "signing_key.pem", **common)
    assert "--open" not in keyed and "--ticket-key" in keyed
