"""`agora snapshot-server`: serve a snapshot store directory over HTTP(S) until stopped, for operators without S3.

GET and HEAD with one byte range (206 / 416), ETag and Last-Modified, If-Range and If-None-Match, files sent with
sendfile on aiohttp (``server.py``), so that joiners resume an interrupted download and never resume a changed file.
Give its URL to the auth service as ``--snapshot-url``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agora_client.http_service import add_exposure_arguments, exposure_from_arguments
from agora_client.system.lifetime import stop_on_signals

from .server import serve_directory

READY_PREFIX = "[SNAPSHOTS] serving "


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=Path, required=True, help="the snapshot store directory (workers publish into it)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    add_exposure_arguments(parser)


def run(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    try:
        args.dir.mkdir(parents=True, exist_ok=True)  # workers publish into it once they run
        server = serve_directory(args.dir, args.host, args.port, exposure=exposure_from_arguments(args))
    except (OSError, ValueError) as error:
        print(f"[ERROR] cannot start the snapshot server: {error}", file=sys.stderr)
        return 2
    print(f"{READY_PREFIX}{args.dir} on {server.url}", flush=True)
    try:
        stop.wait()
    finally:
        server.close()
    return 0
