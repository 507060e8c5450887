"""`agora pause`: pause the running runtime(s) of a config dir from another terminal; `agora resume` (resume_cli)
resumes them. How the command reaches the runtime: agora_client/system/pause_control.py.

Exit codes: 0 when every runtime reached answered (``already paused`` included), 1 when no runtime is running or
one could not be reached.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agora_client.client_config import default_config_dir
from agora_client.system.pause_control import PauseControlError, running_runtimes, send, socket_path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-dir", type=Path, default=None, help="the client's config dir (default: $XDG_CONFIG_HOME/agora)"
    )
    device = parser.add_mutually_exclusive_group()
    device.add_argument(
        "--gpu", type=int, metavar="N", help="only the runtime of this GPU (default: every runtime of the config dir)"
    )
    device.add_argument("--cpu", action="store_true", help="only the runtime started with --cpu")


def run(args: argparse.Namespace) -> int:
    return control(args, "pause")


def control(args: argparse.Namespace, command: str) -> int:
    """Send ``command`` to the chosen runtimes and print each one's answer."""
    config_dir = args.config_dir or default_config_dir()
    chosen = args.gpu is not None or args.cpu
    paths = [socket_path(config_dir, args.gpu)] if chosen else running_runtimes(config_dir)
    reached = 0
    for path in paths:
        try:
            answer = send(path, command)
        except PauseControlError as error:
            print(f"agora {command}: {error}", file=sys.stderr)
            return 1
        if answer is None:  # a runtime that was killed left its socket
            continue
        reached += 1
        print(f"{answer.runtime}: {answer.message}")
        if not answer.ok:
            return 1
    if reached == 0:
        which = f" on {paths[0].stem}" if chosen else ""
        print(
            f"agora {command}: no runtime is running{which} with config dir {config_dir} "
            "(give --config-dir if the client uses another)",
            file=sys.stderr,
        )
        return 1
    return 0
