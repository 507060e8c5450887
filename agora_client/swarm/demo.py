"""`agora demo`: the local tiny swarm plus the contributor client joined to it as one more worker.

The swarm (seeds, one worker per stage publishing snapshots, a trainer, the auth service with a
local demo identity, the snapshot store) runs in the background; the app (or --headless) runs in
the foreground with the demo user's token, through the front end the entry point chose
(``args.front_end``). Quitting the app stops everything. Only the newest ``--keep-runs`` run
directories are kept under ``--run-dir``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from agora_client.frontend.client import configure as configure_client
from agora_client.frontend.client import configure_supervision
from agora_client.frontend.client import run as run_client
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions

RUN_NAME = "%Y%m%d-%H%M%S"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headless", action="store_true", help="print tagged lines instead of opening the app")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/demo"), help="logs, snapshots and state go here")
    parser.add_argument("--workers-per-stage", type=int, default=1)
    parser.add_argument(
        "--keep-runs", type=int, default=3, help="run directories to keep, this one included (default 3)"
    )
    configure_supervision(parser)  # --restart, --notify-cmd: passed to the client as they are


def prune_runs(run_dir: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` demo runs (directories named by their start time); returns the removed."""
    runs = sorted(
        (path for path in run_dir.glob("*") if path.is_dir() and _is_run_name(path.name)), key=lambda p: p.name
    )
    removed = runs[: max(0, len(runs) - keep)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _is_run_name(name: str) -> bool:
    try:
        time.strptime(name, RUN_NAME)
    except ValueError:
        return False
    return True


def client_arguments(
    headless: bool, swarm_url: str, monitor_url: str, config_dir: Path, supervision: tuple[str, ...] = ()
) -> argparse.Namespace:
    """The client's own options for joining the demo swarm (its parser fills in every other default);
    ``supervision``: the demo's --restart and --notify-cmd as client arguments."""
    parser = argparse.ArgumentParser(prog="agora")
    configure_client(parser)
    argv = ["--swarm", swarm_url, "--monitor", monitor_url, "--config-dir", str(config_dir), *supervision]
    argv += ["--host-port", "0"]  # any free port: the demo must not collide with a contributor already on 49200
    argv += ["--cpu"]  # the demo's tiny swarm runs on the CPU, the contributor's worker too
    return parser.parse_args([*argv, *(["--headless"] if headless else [])])


def run(args: argparse.Namespace) -> int:
    prune_runs(args.run_dir, max(0, args.keep_runs - 1))  # room for this run
    run_dir = args.run_dir / time.strftime(RUN_NAME)
    options = SwarmOptions(workers_per_stage=args.workers_per_stage, run_dir=run_dir, publish_snapshots=True)
    print(f"[DEMO] starting the local swarm (logs in {run_dir / 'logs'}); this takes about a minute...", flush=True)
    swarm, services = LocalSwarm(options), {}

    def start_services() -> None:  # they need the seeds, not the workers: they start while the workers build
        services["auth_url"], services["token"] = swarm.start_join_services()
        services["monitor_url"] = swarm.start_monitor(services["auth_url"])

    try:
        swarm.start(beside_workers=start_services)
        auth_url, token, monitor_url = services["auth_url"], services["token"], services["monitor_url"]
        print(f"[DEMO] swarm up; auth service at {auth_url}; leaderboard at {monitor_url}/leaderboard", flush=True)
        print("[DEMO] joining as the demo user", flush=True)
        os.environ["HF_TOKEN"] = token  # the demo identity's token, from the swarm's own token file
        supervision = ("--restart", args.restart, *(("--notify-cmd", args.notify_cmd) if args.notify_cmd else ()))
        client = client_arguments(args.headless, auth_url, monitor_url, run_dir / "client", supervision)
        code = run_client(client, args.front_end)
        print("[DEMO] stopping the swarm...", flush=True)
    finally:
        swarm.stop()
    print(
        f"[DEMO] logs of this run: {run_dir / 'logs'} (swarm) and {run_dir / 'client' / 'logs'} (your client)",
        flush=True,
    )
    return code
