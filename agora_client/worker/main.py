"""`agora worker --stage body1`: host one pipeline stage until stopped (Ctrl-C or SIGTERM)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agora_client.config import ConfigError, load_config
from agora_client.events import EventWriter
from agora_client.discovery.dht import NoSeedAnswered


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", required=True, help="head, body1..bodyN or tail")
    parser.add_argument("--seeds", nargs="+", required=True, help="seed multiaddrs; any one that answers is enough")
    parser.add_argument("--preset", default="tiny", help="run config preset name or YAML path (default: tiny)")
    parser.add_argument("--host", default="127.0.0.1", help="address the worker listens on (default: loopback)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--join", action="store_true", help="join a running swarm through sync phases 1 and 2")
    parser.add_argument("--index", type=int, default=None, help="uid index <stage>.0.<index> (default: lowest free)")
    parser.add_argument("--init-seed", type=int, default=None, help="seed for this worker's initial weights")
    parser.add_argument("--slowdown", type=float, default=0.0, help="seconds added to every request (emulates a slow GPU)")
    parser.add_argument("--slower", type=float, default=1.0, metavar="F",
                        help="every request takes F times its own time (emulates a GPU F times slower; F >= 1)")
    parser.add_argument("--lie", action="store_true", help=argparse.SUPPRESS)  # tests: answer random tensors
    parser.add_argument("--publish-snapshots", default=None, metavar="STORE", help="write stage snapshots here (directory or s3://bucket/prefix)")
    parser.add_argument("--publish-every", type=int, default=5, help="epochs between snapshots (default 5)")
    parser.add_argument("--checkpoints", default=None, metavar="STORE",
                        help="write timestamped checkpoints here (directory or s3://bucket/prefix), every checkpoint.period_s")
    parser.add_argument("--snapshot", type=Path, default=None, help="start from this downloaded snapshot directory")
    parser.add_argument("--events", default=None, help="also write JSON-line events to this file ('-' = stdout)")
    parser.add_argument("--auth-public-key", default=None, help="the auth service's public key: serve only its ticket holders")
    parser.add_argument(
        "--ticket-key", type=Path, default=None, metavar="PEM",
        help="operator-run worker: the auth service's signing key, to issue this worker's own ticket (implies its public key)",
    )
    parser.add_argument(
        "--recover-from", type=Path, default=None, metavar="DIR",
        help="snapshot store directory to reload this stage from if this worker's weights break",
    )


def run(args: argparse.Namespace) -> int:
    from agora_client.system.lifetime import die_with_parent, stop_on_signals

    stop = stop_on_signals()  # before anything forks: helpers must not inherit the handler
    if args.slowdown < 0 or args.slower < 1:
        print(f"[ERROR] --slowdown must be >= 0 and --slower >= 1 (got {args.slowdown}, {args.slower})", file=sys.stderr)
        return 2
    import torch

    from agora_client.auth.ticket_source import SelfIssuedTickets
    from agora_client.snapshots import SnapshotError, latest_snapshot
    from agora_client.worker.node import WorkerNode, WorkerOptions

    die_with_parent()  # a killed worker must not leave hivemind's helpers serving requests

    try:
        config = load_config(args.preset)
        config.model.stage(args.stage)
    except ConfigError as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    events = EventWriter()
    if args.events == "-":
        events.add_sink(sys.stdout)
    elif args.events:
        events.add_sink(open(args.events, "a", buffering=1))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tickets, public_key = None, args.auth_public_key
    if args.ticket_key is not None:
        try:
            tickets = SelfIssuedTickets.from_file(args.ticket_key, role="worker", stage=args.stage)
        except ValueError as error:
            print(f"[ERROR] {error}", file=sys.stderr)
            return 2
        public_key = public_key or tickets.public_key
    recover_from = args.recover_from
    options = WorkerOptions(
        config,
        args.stage,
        args.seeds,
        device=device,
        host=args.host,
        joining=args.join,
        index=args.index,
        init_seed=args.init_seed,
        slowdown_s=args.slowdown,
        slower=args.slower,
        lie=args.lie,
        snapshot=args.snapshot,
        publish_dir=args.publish_snapshots,
        publish_every=args.publish_every,
        checkpoint_store=args.checkpoints,
        auth_public_key=public_key,
        tickets=tickets,
        recovery=(lambda: latest_snapshot(recover_from / args.stage)) if recover_from is not None else None,
    )
    try:
        node = WorkerNode(options, events)
    except NoSeedAnswered as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 1
    except SnapshotError as error:  # a --snapshot that is damaged or from another run config
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    try:
        if not stop.is_set():
            node.start(stop)
            print(f"[WORKER] {node.uid} ready on peer {node.peer_id}", flush=True)
            stop.wait()
        print(f"[WORKER] stopping {node.uid}: leaving the averaging group and the roster...", flush=True)
    finally:
        node.shutdown()
    print(f"[WORKER] {node.uid} stopped", flush=True)
    return 0
