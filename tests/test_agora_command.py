"""A child started with the agora command line runs the parent's agora_client, whatever its working directory holds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agora_client.frontend.supervisor import runtime_command
from agora_client.swarm.processes import CLI
from agora_client.system.agora_command import AGORA


def test_a_child_runs_the_parents_agora_client_from_any_working_directory(tmp_path: Path) -> None:
    # `python -c` puts the cwd first on sys.path: a cwd that is not the checkout (the demo's from elsewhere, a
    # service's) must neither miss agora_client nor load another copy of it
    shadow = tmp_path / "agora_client"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the agora_client of the working directory')\n")
    for argv in (CLI, list(runtime_command(token="t").argv[: len(AGORA)])):
        done = subprocess.run([*argv, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
