"""`agora_cli.py export-logs`: write a support bundle and say where it is.

Without ``--config-dir`` it bundles the most recent run's logs: those of the saved client
config (``~/.config/agora``) or of a demo run under ``./runs/demo``, whichever logged last,
and says which it chose.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agora_client.client_config import default_config_dir
from agora_client.logs import logs_dir
from agora_client.system.bundle import REVIEW_NOTE, build_bundle, recent_logs

DEMO_RUNS = Path("runs") / "demo"


def latest_client_dir(candidates: list[Path]) -> Path | None:
    """The config dir among candidates whose logs were written last (None if none has logs)."""
    newest: tuple[float, Path] | None = None
    for config_dir in candidates:
        logs = recent_logs(logs_dir(config_dir))
        if logs and (newest is None or logs[0].stat().st_mtime > newest[0]):
            newest = (logs[0].stat().st_mtime, config_dir)
    return newest[1] if newest else None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="client config dir (default: the most recent run's: ~/.config/agora or ./runs/demo/<run>/client)",
    )
    parser.add_argument("--output", type=Path, default=Path.cwd(), help="directory for the zip (default: here)")
    parser.add_argument("--max-log-mb", type=float, default=2.0, help="newest MB kept from each log file")


def run(args: argparse.Namespace) -> int:
    config_dir = args.config_dir
    if config_dir is None:
        candidates = [default_config_dir(), *sorted(DEMO_RUNS.glob("*/client"))]
        config_dir = latest_client_dir(candidates) or default_config_dir()
        print(f"Bundling the logs of the most recent run, in {logs_dir(config_dir)} (choose another with --config-dir)")
    if args.max_log_mb <= 0:
        print("--max-log-mb must be positive, e.g. --max-log-mb 2")
        return 2
    try:
        path = build_bundle(
            args.output,
            config_dir=config_dir,
            logs_dir=logs_dir(config_dir),
            max_log_bytes=int(args.max_log_mb * 2**20),
        )
    except OSError as error:
        print(f"Could not write the support bundle: {error}. Choose another directory with --output.")
        return 1
    print(f"Support bundle written to {path}")
    print(REVIEW_NOTE)
    return 0
