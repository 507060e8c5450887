"""`agora auth`: run the auth service until stopped (SIGINT / SIGTERM)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Callable

from agora_client.config import ConfigError, RunConfig, load_config
from agora_client.data.tokenizer import TokenizerError, load_run_tokenizer
from agora_client.http_service import Exposure, add_exposure_arguments, exposure_from_arguments
from agora_client.system.lifetime import stop_on_signals

from .admission import AdmissionPolicy
from .identity import HuggingFaceIdentity, IdentityError, IdentitySource, TokenFileIdentity
from .presence import DhtRosters, PresenceWatcher
from .reachability import AnnounceError, parse_announce
from .run_description import TokenizerSummary, describe_run
from .server import AuthServer, AuthService, ServiceSettings
from .stage_demand import parse_stage_targets, run_demand

READY_PREFIX = "[AUTH] listening on "
PUBLIC_KEY_PREFIX = "[AUTH] public key "
log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    _add_service_arguments(parser)
    _add_identity_arguments(parser)
    _add_admission_arguments(parser)
    _add_run_description_arguments(parser)
    _add_presence_arguments(parser)
    add_exposure_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def _add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the service listens, what it keeps on disk and which run it describes."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path.home() / ".agora" / "auth",
        help="holds the signing key, the token-hash secret and the join audit log",
    )
    parser.add_argument(
        "--config", default="tiny", help="run preset or YAML file: gives the stage names (default: tiny)"
    )


def _add_identity_arguments(parser: argparse.ArgumentParser) -> None:
    """How a joiner's token is checked."""
    parser.add_argument(
        "--identity",
        choices=("huggingface", "token-file"),
        default="huggingface",
        help="how tokens are checked (default: huggingface)",
    )
    parser.add_argument("--token-file", type=Path, help="JSON/YAML file of tokens for --identity token-file")
    parser.add_argument(
        "--hf-endpoint", default=None, help="Hugging Face endpoint (default: $HF_ENDPOINT or huggingface.co)"
    )


def _add_admission_arguments(parser: argparse.ArgumentParser) -> None:
    """How many peers a stage takes, how fast, and how long a ticket lasts."""
    parser.add_argument("--max-workers-per-stage", type=int, default=8)
    parser.add_argument("--per-identity-cap", type=int, default=2, help="active peers one identity may run")
    parser.add_argument("--pacing", type=float, default=30.0, help="seconds between two admissions to one stage")
    parser.add_argument("--max-pending", type=int, default=1, help="admitted peers per stage not yet reporting active")
    parser.add_argument(
        "--integration-timeout",
        type=float,
        default=600.0,
        help="seconds after which an admitted peer no longer holds back joins to its stage",
    )
    parser.add_argument("--ticket-ttl", type=float, default=3600.0, help="ticket lifetime in seconds (renewable)")
    parser.add_argument(
        "--stage-target",
        action="append",
        default=[],
        dest="stage_targets",
        metavar="STAGE=N",
        help="workers STAGE should have, instead of the share its compute per microbatch asks for (repeatable)",
    )


def _add_run_description_arguments(parser: argparse.ArgumentParser) -> None:
    """Where joiners find snapshots, seeds, relays and the monitor."""
    parser.add_argument(
        "--snapshot-url",
        default=None,
        help="snapshot store base URL (<base>/<stage>/latest.json), a template with {stage}, or "
        "s3://bucket/prefix (joiners get presigned URLs; endpoint and keys from AWS_* variables)",
    )
    parser.add_argument(
        "--seed", action="append", default=[], dest="seeds", help="seed multiaddr for clients (repeatable)"
    )
    parser.add_argument(
        "--relay",
        action="append",
        default=[],
        dest="relays",
        metavar="HOST:PORT",
        help="a relay (agora relay) for workers no port mapping can open, given to joiners (repeatable)",
    )
    parser.add_argument(
        "--monitor-url", default=None, help="the monitor's base URL, given to joiners in the run description"
    )


def _add_presence_arguments(parser: argparse.ArgumentParser) -> None:
    """Checking a joiner can be reached, and freeing the slots of peers gone from the DHT."""
    parser.add_argument(
        "--dial-back",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="connect back to each joiner's announced port before admitting it (default: on)",
    )
    parser.add_argument("--dial-timeout", type=float, default=5.0, help="seconds a dial-back may take")
    parser.add_argument(
        "--vanish-after",
        type=float,
        default=120.0,
        help="free the slot of a peer absent from its stage's DHT roster this many seconds",
    )
    parser.add_argument("--presence-every", type=float, default=30.0, help="seconds between two reads of the rosters")


def build_identity_source(args: argparse.Namespace) -> IdentitySource:
    if args.identity == "token-file":
        if args.token_file is None:
            raise ValueError("--identity token-file needs --token-file PATH")
        return TokenFileIdentity(args.token_file)
    return HuggingFaceIdentity(args.hf_endpoint)


def _object_store_links(location: str | None) -> Callable[[str], str | None] | None:
    """For an s3:// snapshot store: presigned links per stage (None, logged, if the bucket cannot be read)."""
    if not location or not location.startswith("s3://"):
        return None
    from agora_client.snapshots import SnapshotError, open_store  # boto3 only for an S3 store

    try:
        store = open_store(location)
    except SnapshotError as error:  # raised as ValueError: run() prints it as a start-up error
        raise ValueError(str(error)) from None

    def links(stage: str) -> str | None:
        try:
            return store.joiner_url(stage)
        except SnapshotError as error:
            log.warning("no snapshot link for stage %s: %s", stage, error)
            return None

    return links


def build_settings(args: argparse.Namespace, config: RunConfig) -> ServiceSettings:
    """The service's settings: admission policy, snapshot links, and the run description with the run's tokenizer."""
    policy = AdmissionPolicy(
        stages=config.model.stage_names,
        max_workers_per_stage=args.max_workers_per_stage,
        per_identity_cap=args.per_identity_cap,
        pacing_s=args.pacing,
        max_pending_per_stage=args.max_pending,
        integration_timeout_s=args.integration_timeout,
        ticket_ttl_s=args.ticket_ttl,
        demand=run_demand(config, args.max_workers_per_stage, parse_stage_targets(args.stage_targets)),
    )
    seeds = tuple(args.seeds)
    for relay in args.relays:
        try:
            parse_announce(relay)
        except AnnounceError:
            raise ValueError(
                f"--relay {relay!r} is not HOST:PORT: give the relay's public address and control port"
            ) from None
    links = _object_store_links(args.snapshot_url)
    tokenizer = load_run_tokenizer(config)  # joiners check the served file against the description's sha256
    return ServiceSettings(
        policy=policy,
        snapshot_url=None if links else args.snapshot_url,
        seeds=seeds,
        snapshot_links=links,
        run=describe_run(
            config,
            seeds,
            args.snapshot_url,
            args.monitor_url,
            TokenizerSummary.of(tokenizer),
            relays=tuple(args.relays),
        ),
        tokenizer_json=tokenizer.content,
        dial_back=args.dial_back,
        dial_timeout_s=args.dial_timeout,
        key_proof=True,
    )


def _warn_if_tokens_travel_in_clear(host: str, exposure: Exposure) -> None:
    if exposure.tls is None and not exposure.trusted_proxies and not _is_loopback(host):
        print(
            f"[AUTH] warning: plain HTTP on {host}: contributors' Hugging Face tokens cross the network in clear text; "
            "give --tls-cert and --tls-key, or serve behind a TLS proxy named with --trusted-proxy",
            file=sys.stderr,
            flush=True,
        )


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        settings = build_settings(args, config)
        exposure = exposure_from_arguments(args)
        service = AuthService(settings, build_identity_source(args), args.state_dir)
        server = AuthServer(service, args.host, args.port, exposure=exposure)
    except (ConfigError, TokenizerError, IdentityError, ValueError, OSError) as error:
        print(f"[ERROR] cannot start the auth service: {error}", file=sys.stderr)
        return 2
    _warn_if_tokens_travel_in_clear(args.host, exposure)
    stages, seeds, policy = config.model.stage_names, settings.seeds, settings.policy
    if len(seeds) < 2:
        print(
            f"[AUTH] warning: {len(seeds)} seed(s) given; give two or more (--seed) so joiners survive a "
            "seed going down",
            file=sys.stderr,
            flush=True,
        )
    watcher = None
    if seeds:
        rosters = DhtRosters(seeds, host=args.host)
        watcher = PresenceWatcher(
            service.book, stages, rosters.read, every_s=args.presence_every, vanish_s=args.vanish_after
        ).start()
    with server:
        print(f"{READY_PREFIX}{server.url}", flush=True)
        print(f"{PUBLIC_KEY_PREFIX}{service.public_key}", flush=True)
        print(
            f"[AUTH] identities: {service.identities.describe()}; stages {', '.join(stages)}, "
            f"{policy.max_workers_per_stage} slots each; run {config.name} {settings.run.hash[:19]}",
            flush=True,
        )
        targets = ", ".join(f"{need.stage} {need.target:.1f}" for need in policy.stage_demand.needs)
        print(f"[AUTH] target workers per stage (plan's compute, or --stage-target): {targets}", flush=True)
        print(
            f"[AUTH] tokenizer {config.tokenizer.source}: sha256 {settings.run.tokenizer.sha256[:16]}, "
            f"{settings.run.tokenizer.vocab_size:,} tokens, served at {server.url}/v1/tokenizer",
            flush=True,
        )
        stop.wait()
    if watcher is not None:
        watcher.close()
        rosters.close()
    return 0
