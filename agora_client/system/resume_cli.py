"""`agora resume`: resume the runtime(s) `agora pause` paused (agora_client/system/pause_cli.py)."""

from __future__ import annotations

import argparse

from agora_client.system.pause_cli import configure, control

__all__ = ["configure", "run"]


def run(args: argparse.Namespace) -> int:
    return control(args, "resume")
