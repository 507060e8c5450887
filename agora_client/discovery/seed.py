"""`agora seed`: a stateless DHT bootstrap peer that prints its multiaddr and stays up until stopped."""

from __future__ import annotations

import argparse
import sys

from agora_client.discovery.dht import connect_dht
from agora_client.discovery.operator_metrics import seed_collector
from agora_client.operator_metrics import MetricsUnavailable, add_metrics_arguments, open_metrics_endpoint
from agora_client.system.lifetime import stop_on_signals

READY_PREFIX = "[SEED] multiaddr "


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    parser.add_argument("--seeds", nargs="*", default=[], help="other seeds to connect to")
    parser.add_argument("--identity", default=None, help="key file that keeps the peer id stable across restarts")
    add_metrics_arguments(parser)


def run(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    try:
        metrics = open_metrics_endpoint(args, "seed")
    except MetricsUnavailable as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    extra = {"identity_path": args.identity} if args.identity else {}
    dht = connect_dht(args.seeds, host=args.host, port=args.port, **extra)
    metrics.add(seed_collector(dht))
    try:
        for maddr in dht.get_visible_maddrs():
            print(f"{READY_PREFIX}{maddr}", flush=True)
        stop.wait()
    finally:
        dht.shutdown()
        metrics.close()
    return 0
