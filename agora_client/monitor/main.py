"""`agora monitor`: scrape the stages' signed metrics and the trainers' progress, keep points and the learning
curve in SQLite, serve the leaderboard and the curve over HTTP."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

import httpx

from agora_client.auth.tickets import load_public_key
from agora_client.config import ConfigError, load_config
from agora_client.discovery.dht import NoSeedAnswered, connect_dht
from agora_client.http_service import Exposure, add_exposure_arguments, exposure_from_arguments
from agora_client.monitor.http_api import LeaderboardServer
from agora_client.monitor.page import run_info
from agora_client.monitor.points import PointsPolicy
from agora_client.monitor.scraper import Scraper
from agora_client.monitor.store import PointsStore
from agora_client.system.lifetime import stop_on_signals

READY_PREFIX = "[MONITOR] leaderboard on "
log = logging.getLogger("agora_client.monitor")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        action="extend",
        default=[],
        metavar="MULTIADDR",
        help="seed multiaddrs to join the DHT through (required)",
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--auth-public-key", help="the auth service's ticket public key (base64, from its /v1/status)")
    key.add_argument("--auth-url", help="auth service base URL: its public key is read from GET /v1/status")
    parser.add_argument(
        "--config", default="tiny", help="run preset or YAML file: gives the stage names (default: tiny)"
    )
    parser.add_argument("--stages", default=None, help="comma-separated stages to scrape (default: all of --config)")
    parser.add_argument(
        "--db",
        type=Path,
        default=Path.home() / ".agora" / "monitor" / "points.sqlite",
        help="SQLite file that keeps the totals across restarts",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default: loopback)")
    parser.add_argument(
        "--port",
        type=int,
        default=8090,
        help="HTTP port (default: 8090, where `agora leaderboard` looks; 0: any free port)",
    )
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between two scrapes")
    parser.add_argument("--identity-cap", type=int, default=2, help="peers of one identity that earn at a time")
    parser.add_argument(
        "--online-window",
        type=float,
        default=None,
        help="seconds without a record after which a peer is offline (default: max(90, 3 x interval))",
    )
    add_exposure_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def auth_public_key(args: argparse.Namespace) -> str:
    """The ticket-verifying key, given directly or read from the auth service; ValueError says what to fix."""
    if args.auth_public_key:
        text = args.auth_public_key
    elif args.auth_url:
        url = f"{args.auth_url.rstrip('/')}/v1/status"
        try:
            response = httpx.get(url, timeout=10.0)
            response.raise_for_status()
            text = response.json()["public_key"]
        except httpx.HTTPError as error:
            raise ValueError(
                f"could not read the auth public key from {url} ({error}); is the auth service running?"
            ) from None
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{url} did not answer JSON with a public_key; is --auth-url an Agora auth service?"
            ) from None
    else:
        raise ValueError("give --auth-public-key KEY or --auth-url URL: tickets cannot be checked without the key")
    load_public_key(text)  # fails now, with what to do, rather than on every record
    return text


def _check(args: argparse.Namespace) -> Exposure:
    """The TLS and trusted proxies the flags ask for, once they are checked (ValueError says what to fix)."""
    if not args.initial_peers:
        raise ValueError("give --initial-peers MULTIADDR [...]: the monitor reads the metrics from the swarm's DHT")
    if args.interval <= 0:
        raise ValueError(f"--interval must be positive, got {args.interval}")
    if args.identity_cap < 1:
        raise ValueError(f"--identity-cap must be at least 1, got {args.identity_cap}")
    return exposure_from_arguments(args)


def run(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        exposure = _check(args)
        config = load_config(args.config)
        stages = _stages_to_scrape(args.stages, config.model.stage_names)
        public_key = auth_public_key(args)
        store = _open_store(args)
    except (ConfigError, ValueError, OSError) as error:
        print(f"[MONITOR] cannot start the monitor: {error}", file=sys.stderr)
        return 2
    try:
        server = LeaderboardServer(store, args.host, args.port, run=run_info(config), exposure=exposure)
    except OSError as error:
        print(f"[MONITOR] cannot listen on {args.host}:{args.port}: {error}; pick another --port", file=sys.stderr)
        store.close()
        return 2
    try:
        # client mode: the monitor only reads; the validators drop records whose signature or schema is wrong.
        dht = connect_dht(args.initial_peers, host=args.host, client_mode=True)
    except NoSeedAnswered as error:
        print(f"[MONITOR] cannot start the monitor: {error}", file=sys.stderr)
        server.server_close()
        store.close()
        return 2

    scraper = Scraper(dht, stages, store, public_key, auth_url=args.auth_url)
    _start_serving(server, stages, args)
    try:
        _scrape_until_stopped(scraper, stop, args.interval)
    finally:
        server.stop()
        dht.shutdown()
        store.close()
    return 0


def _stages_to_scrape(names: str | None, stages: tuple[str, ...]) -> tuple[str, ...]:
    """The run's stages, or those ``--stages`` names (comma-separated); ValueError names a stage the run lacks."""
    if not names:
        return stages
    wanted = tuple(name.strip() for name in names.split(",") if name.strip())
    unknown = [name for name in wanted if name not in stages]
    if unknown:
        raise ValueError(f"--stages names unknown stage(s) {', '.join(unknown)}; this run has {', '.join(stages)}")
    return wanted


def _open_store(args: argparse.Namespace) -> PointsStore:
    """The points database, crediting under the identity cap and online window the flags give."""
    window = args.online_window if args.online_window is not None else max(90.0, 3 * args.interval)
    return PointsStore(args.db, PointsPolicy(identity_cap=args.identity_cap, online_window_s=window))


def _start_serving(server: LeaderboardServer, stages: tuple[str, ...], args: argparse.Namespace) -> None:
    """Start the HTTP API and say where the leaderboard is (the ready line) and what is scraped how often."""
    server.start()
    print(f"{READY_PREFIX}{server.url}/leaderboard", flush=True)
    print(f"[MONITOR] scraping {', '.join(stages)} every {args.interval:g}s into {args.db}", flush=True)


def _scrape_until_stopped(scraper: Scraper, stop: threading.Event, interval: float) -> None:
    """Scrape every ``interval`` seconds until ``stop`` is set."""
    while not stop.is_set():
        try:
            updated = scraper.scrape_once()
            log.debug("scrape credited %d peer(s)", len(updated))
        except Exception:  # a failed scrape (DHT hiccup) must not stop the service: the next one retries
            log.exception("scrape failed; retrying in %.0fs", interval)
        stop.wait(interval)
