"""`agora relay`: run a relay for workers no port mapping can open, until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

from agora_client.operator_metrics import add_metrics_arguments, open_metrics_endpoint
from agora_client.system.lifetime import stop_on_signals

from .operator_metrics import relay_collector
from .server import RelayServer, RelaySettings

READY_PREFIX = "[RELAY] listening on "


def port_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not sep or not low.isdigit() or not high.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range: expected LO-HI, e.g. 50000-50100")
    return int(low), int(high)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="0.0.0.0", help="address to listen on, control and public ports (default: all interfaces)"
    )
    parser.add_argument("--port", type=int, default=0, help="control port workers connect to (default: any free port)")
    parser.add_argument("--public-host", required=True, help="host name or address of this relay as peers reach it")
    parser.add_argument("--ports", type=port_range, required=True, help="public ports to hand out, LO-HI")
    parser.add_argument(
        "--auth-public-key",
        required=True,
        help="the auth service's public key (public_key of its /v1/status): only joiners holding its relay pass or "
        "ticket reserve",
    )
    parser.add_argument("--max-reservations", type=int, default=64, help="reservations held at once (default: 64)")
    parser.add_argument(
        "--per-network", type=int, default=4, help="reservations one IPv4 /24 or IPv6 /64 may hold (default: 4)"
    )
    parser.add_argument("--per-identity", type=int, default=4, help="reservations one account may hold (default: 4)")
    parser.add_argument(
        "--ping-every",
        type=float,
        default=20.0,
        help="seconds between keepalive pings; three unanswered release a reservation (default: 20)",
    )
    add_metrics_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def run(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = RelaySettings(
            host=args.host,
            port=args.port,
            public_host=args.public_host,
            port_lo=args.ports[0],
            port_hi=args.ports[1],
            auth_public_key=args.auth_public_key,
            max_reservations=args.max_reservations,
            per_network=args.per_network,
            per_identity=args.per_identity,
            ping_every_s=args.ping_every,
        )
        metrics = open_metrics_endpoint(args, "relay")  # MetricsUnavailable is a ValueError
        server = RelayServer(settings).start()
    except (ValueError, OSError) as error:
        print(f"[ERROR] cannot start the relay: {error}", file=sys.stderr)
        return 2
    metrics.add(relay_collector(server))
    print(
        f"{READY_PREFIX}{settings.host}:{server.port} for public {settings.public_host}, "
        f"ports {settings.port_lo}-{settings.port_hi}",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        server.stop()
        metrics.close()
    return 0
