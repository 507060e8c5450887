"""`agora_cli.py export-logs`: write a support bundle and say where it is."""

from __future__ import annotations

import argparse
from pathlib import Path

from agora_client.client_config import default_config_dir
from agora_client.logs import logs_dir
from agora_client.system.bundle import REVIEW_NOTE, build_bundle


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config-dir", type=Path, default=None, help="client config dir (default: ~/.config/agora)")
    parser.add_argument("--output", type=Path, default=Path.cwd(), help="directory for the zip (default: here)")
    parser.add_argument("--max-log-mb", type=float, default=2.0, help="newest MB kept from each log file")


def run(args: argparse.Namespace) -> int:
    config_dir = args.config_dir or default_config_dir()
    if args.max_log_mb <= 0:
        print("--max-log-mb must be positive, e.g. --max-log-mb 2")
        return 2
    try:
        path = build_bundle(
            args.output, config_dir=config_dir, logs_dir=logs_dir(config_dir), max_log_bytes=int(args.max_log_mb * 2**20)
        )
    except OSError as error:
        print(f"Could not write the support bundle: {error}. Choose another directory with --output.")
        return 1
    print(f"Support bundle written to {path}")
    print(REVIEW_NOTE)
    return 0
