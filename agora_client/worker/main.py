"""`agora worker --stage body1`: host one pipeline stage until stopped (Ctrl-C or SIGTERM)."""

from __future__ import annotations

import argparse
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from agora_client.config import ConfigError, RunConfig, load_config
from agora_client.discovery.dht import NoSeedAnswered
from agora_client.events import EventWriter
from agora_client.operator_metrics import (
    MetricsEndpoint,
    MetricsUnavailable,
    add_metrics_arguments,
    open_metrics_endpoint,
)
from agora_client.worker.operator_metrics import watch_worker

if TYPE_CHECKING:
    from agora_client.auth.ticket_source import SelfIssuedTickets
    from agora_client.worker.node import WorkerNode, WorkerOptions
    from agora_client.worker.relayed import RelayedPort

RELAY_LISTEN_HOSTS = ("127.0.0.1", "0.0.0.0")  # the relay's connections reach the worker on 127.0.0.1
SERVING_CHECK_S = 1.0  # how often a serving worker checks that hivemind's server thread still runs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", required=True, help="head, body1..bodyN or tail")
    parser.add_argument("--seeds", nargs="+", required=True, help="seed multiaddrs; any one that answers is enough")
    parser.add_argument("--preset", default="tiny", help="run config preset name or YAML path (default: tiny)")
    parser.add_argument("--host", default="127.0.0.1", help="address the worker listens on (default: loopback)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--join", action="store_true", help="join a running swarm through sync phases 1 and 2")
    parser.add_argument("--index", type=int, default=None, help="uid index <stage>.0.<index> (default: lowest free)")
    parser.add_argument("--init-seed", type=int, default=None, help="seed for this worker's initial weights")
    parser.add_argument(
        "--publish-snapshots",
        default=None,
        metavar="STORE",
        help="write stage snapshots here (directory or s3://bucket/prefix)",
    )
    parser.add_argument("--publish-every", type=int, default=5, help="epochs between snapshots (default 5)")
    parser.add_argument(
        "--checkpoints",
        default=None,
        metavar="STORE",
        help="write timestamped checkpoints here (directory or s3://bucket/prefix), every checkpoint.period_s",
    )
    parser.add_argument("--snapshot", type=Path, default=None, help="start from this downloaded snapshot directory")
    parser.add_argument("--events", default=None, help="also write JSON-line events to this file ('-' = stdout)")
    _add_admission_arguments(parser)
    parser.add_argument(
        "--recover-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="snapshot store directory to reload this stage from if this worker's weights break",
    )
    parser.add_argument(
        "--relay",
        default=None,
        metavar="HOST:PORT",
        help="serve through this relay (agora relay) when no port mapping can open this machine: the worker reserves "
        "a port there and announces only that one",
    )
    add_metrics_arguments(parser)


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """Whom the worker serves: ticket holders of the auth service's key, or anyone with --open."""
    parser.add_argument(
        "--auth-public-key", default=None, help="the auth service's public key: serve only its ticket holders"
    )
    parser.add_argument(
        "--open",
        action="store_true",
        help="serve and average with anyone, without tickets (a private test swarm only; it warns): the worker "
        "refuses to start without --auth-public-key or --ticket-key otherwise",
    )
    parser.add_argument(
        "--ticket-key",
        type=Path,
        default=None,
        metavar="PEM",
        help="operator-run worker: the auth service's signing key, to issue this worker's own ticket (implies its "
        "public key)",
    )


class _CannotStart(Exception):
    """A step that ends the worker before it starts: the message (for stderr) and the exit code."""

    def __init__(self, error: Exception, code: int):
        super().__init__(str(error))
        self.code = code


def run(args: argparse.Namespace) -> int:
    """Host the stage until stopped.

    Returns 0 then; 1 when no seed answers or hivemind's server thread died; 2 for a bad stage or config, ticket key
    or snapshot."""
    from agora_client.system.lifetime import die_with_parent, stop_on_signals

    stop = stop_on_signals()  # before anything forks: helpers must not inherit the handler
    die_with_parent()  # a killed worker must not leave hivemind's helpers serving requests
    with ExitStack() as on_exit:  # gives the relay's port back however the worker ends
        try:
            metrics = on_exit.enter_context(_metrics_endpoint(args))
            relay = on_exit.enter_context(_reserve_relay(args)) if args.relay is not None else None
            node = _create_node(args, relay)
        except _CannotStart as failure:
            print(f"[ERROR] {failure}", file=sys.stderr)
            return failure.code
        metrics.add(watch_worker(node))
        return _serve_until_stopped(node, stop)


def _metrics_endpoint(args: argparse.Namespace) -> MetricsEndpoint:
    try:
        return open_metrics_endpoint(args, "worker")
    except MetricsUnavailable as error:
        raise _CannotStart(error, 2) from error


def _reserve_relay(args: argparse.Namespace) -> RelayedPort:
    """A port on ``--relay`` whose connections reach this worker's own port on 127.0.0.1, before its DHT starts
    (reserved again after a loss), reserved with this worker's own ticket (``--ticket-key``)."""
    from agora_client.relay import RelayUnavailable
    from agora_client.worker.relayed import reserve_relayed_port

    if args.host not in RELAY_LISTEN_HOSTS:
        raise _CannotStart(
            ValueError(
                f"--relay with --host {args.host}: the relay's connections arrive on 127.0.0.1; "
                "leave --host out or give --host 127.0.0.1"
            ),
            2,
        )
    tickets, _ = _tickets(args)
    if tickets is None:
        raise _CannotStart(
            ValueError(
                "--relay needs --ticket-key: a relay holds ports only for the auth service's ticket or relay pass "
                "holders, and this worker signs its own ticket with that key"
            ),
            2,
        )
    try:
        relayed, address = reserve_relayed_port(args.relay, tickets, on_lost=_relay_lost, on_restored=_relay_restored)
    except RelayUnavailable as error:
        raise _CannotStart(error, 1) from error
    print(
        f"[NETWORK] serving through the relay {args.relay}: the swarm reaches this worker at {address}, "
        f"about {relayed.rtt_s * 1000:.0f} ms more per round trip",
        flush=True,
    )
    return relayed


def _relay_lost(reason: str) -> None:
    print(
        f"[WARNING] the relay dropped this worker's port ({reason}): the swarm cannot reach this worker until "
        "the relay holds it again; reserving it again",
        file=sys.stderr,
        flush=True,
    )


def _relay_restored(address: str, same: bool) -> None:
    if same:
        print(f"[NETWORK] the relay holds this worker's port again: the swarm reaches it at {address}", flush=True)
    else:
        print(
            f"[WARNING] the relay holds this worker at a new address, {address}, which the swarm does not know: "
            "restart the worker to announce it",
            file=sys.stderr,
            flush=True,
        )


def _create_node(args: argparse.Namespace, relay: RelayedPort | None) -> WorkerNode:
    """The worker for ``--stage``, not yet started: config, events, options, then the node (joins the DHT)."""
    from agora_client.snapshots import SnapshotError
    from agora_client.worker.node import WorkerNode

    config = _load_config(args)
    events = _event_writer(args)
    options = _worker_options(args, config, relay)
    _warn_if_host_memory_short(options, events)
    try:
        return WorkerNode(options, events)
    except NoSeedAnswered as error:
        raise _CannotStart(error, 1) from error
    except SnapshotError as error:  # a --snapshot that is damaged or from another run config
        raise _CannotStart(error, 2) from error


def _warn_if_host_memory_short(options: WorkerOptions, events: EventWriter) -> None:
    """Say so when this machine has less host memory available than the stage's plan needs (with the host copy
    of its state, when it publishes snapshots or writes checkpoints): the worker starts anyway, its operator's call."""
    import psutil

    from agora_client.model.memory import gib, plan_stage

    writes_state = options.publish_dir is not None or options.checkpoint_store is not None
    plan = plan_stage(options.config, options.stage, layout=options.layout)
    need = plan.host_need(options.device != "cpu", writes_state=writes_state)
    available = psutil.virtual_memory().available
    if available < need:
        copy = ", with the host copy of its state for snapshots and checkpoints" if writes_state else ""
        events.log(
            f"stage {options.stage} needs {gib(need)} of host memory{copy}; this machine has {gib(available)} "
            "available: it may be killed for memory",
            tag="WARNING",
            level="warning",
        )


def _load_config(args: argparse.Namespace) -> RunConfig:
    """The run config of ``--preset``, checked to have ``--stage``."""
    try:
        config = load_config(args.preset)
        config.model.stage(args.stage)
    except ConfigError as error:
        raise _CannotStart(error, 2) from error
    return config


def _event_writer(args: argparse.Namespace) -> EventWriter:
    """Events to ``--events``: stdout for '-', else appended to that file; nowhere without it."""
    events = EventWriter()
    if args.events == "-":
        events.add_sink(sys.stdout)
    elif args.events:
        events.add_sink(open(args.events, "a", buffering=1))
    return events


def _worker_options(args: argparse.Namespace, config: RunConfig, relay: RelayedPort | None) -> WorkerOptions:
    """The worker's options from the command line: device, tickets, snapshots to start from, publish and recover from,
    and its DHT's port and announced address when served through a relay."""
    from agora_client.snapshots import latest_snapshot
    from agora_client.worker.node import WorkerOptions

    device = _device(args)
    tickets, public_key = _tickets(args)
    recover_from = args.recover_from
    return WorkerOptions(
        config,
        args.stage,
        args.seeds,
        device=device,
        host=args.host,
        joining=args.join,
        index=args.index,
        init_seed=args.init_seed,
        snapshot=args.snapshot,
        publish_dir=args.publish_snapshots,
        publish_every=args.publish_every,
        checkpoint_store=args.checkpoints,
        auth_public_key=public_key,
        tickets=tickets,
        recovery=(lambda: latest_snapshot(recover_from / args.stage)) if recover_from is not None else None,
        dht_kwargs=relay.dht_kwargs() if relay is not None else {},
    )


def _device(args: argparse.Namespace) -> str:
    """``--device``, else cuda if available, else cpu."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _tickets(args: argparse.Namespace) -> tuple[SelfIssuedTickets | None, str | None]:
    """The worker's own tickets when given ``--ticket-key``, and the auth public key it serves (None: serves anyone)."""
    from agora_client.auth.ticket_source import SelfIssuedTickets

    if args.ticket_key is None:
        if args.auth_public_key is None and not args.open:
            raise _CannotStart(
                ValueError(
                    "no --auth-public-key or --ticket-key: this worker would serve and average with anyone. Give the "
                    "auth service's public key, or --open for a private test swarm"
                ),
                2,
            )
        return None, args.auth_public_key
    try:
        tickets = SelfIssuedTickets.from_file(args.ticket_key, role="worker", stage=args.stage)
    except ValueError as error:
        raise _CannotStart(error, 2) from error
    return tickets, args.auth_public_key or tickets.public_key


def _serve_until_stopped(node: WorkerNode, stop: threading.Event) -> int:
    """Start the node unless already stopped, serve until ``stop`` is set or hivemind's server thread dies (1: a
    supervisor starts the worker again), then leave and shut it down."""
    code = 0
    try:
        if not stop.is_set():
            node.start(stop)
            print(f"[WORKER] {node.uid} ready on peer {node.peer_id}", flush=True)
            code = _wait_while_serving(node, stop)
        print(f"[WORKER] stopping {node.uid}: leaving the averaging group and the roster...", flush=True)
    finally:
        node.shutdown()
    print(f"[WORKER] {node.uid} stopped", flush=True)
    return code


def _wait_while_serving(node: WorkerNode, stop: threading.Event) -> int:
    while not stop.wait(SERVING_CHECK_S):
        if not node.serving:
            print(
                f"[ERROR] {node.uid}: hivemind's server thread stopped (its error is above): this worker would answer "
                "nothing while still listed; it leaves",
                file=sys.stderr,
                flush=True,
            )
            return 1
    return 0
