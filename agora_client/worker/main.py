"""`agora worker --stage body1`: host one pipeline stage until stopped (Ctrl-C or SIGTERM)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from agora_client.config import ConfigError, load_config
from agora_client.events import EventWriter
from agora_client.swarm.dht import NoSeedAnswered


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", required=True, help="head, body1..bodyN or tail")
    parser.add_argument("--seeds", nargs="+", required=True, help="seed multiaddrs; any one that answers is enough")
    parser.add_argument("--preset", default="tiny", help="run config preset name or YAML path (default: tiny)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--join", action="store_true", help="join a running swarm through sync phases 1 and 2")
    parser.add_argument("--index", type=int, default=None, help="uid index <stage>.0.<index> (default: lowest free)")
    parser.add_argument("--init-seed", type=int, default=None, help="seed for this worker's initial weights")
    parser.add_argument("--slowdown", type=float, default=0.0, help="seconds added to every request (emulates a slow GPU)")
    parser.add_argument("--lie", action="store_true", help=argparse.SUPPRESS)  # tests: answer random tensors
    parser.add_argument("--publish-snapshots", type=Path, default=None, metavar="DIR", help="write stage snapshots here")
    parser.add_argument("--publish-every", type=int, default=5, help="epochs between snapshots (default 5)")
    parser.add_argument("--snapshot", type=Path, default=None, help="start from this downloaded snapshot directory")
    parser.add_argument("--events", default=None, help="also write JSON-line events to this file ('-' = stdout)")


def run(args: argparse.Namespace) -> int:
    import torch

    from agora_client.worker.node import WorkerNode, WorkerOptions
    from agora_client.system.lifetime import die_with_parent

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
    options = WorkerOptions(
        config,
        args.stage,
        args.seeds,
        device=device,
        joining=args.join,
        index=args.index,
        init_seed=args.init_seed,
        slowdown_s=args.slowdown,
        lie=args.lie,
        snapshot=args.snapshot,
        publish_dir=args.publish_snapshots,
        publish_every=args.publish_every,
    )
    try:
        node = WorkerNode(options, events)
    except NoSeedAnswered as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    node.start()
    print(f"[WORKER] {node.uid} ready on peer {node.peer_id}", flush=True)
    stop.wait()
    node.shutdown()
    return 0
