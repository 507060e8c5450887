"""`agora swarm`: a whole swarm on this machine, every role a real process on 127.0.0.1 (or ``--host``).

Two seeds, then workers for every stage, then trainers. The trainers' progress lines (loss) are
relayed to the console; every process writes its own log under the run directory. Ctrl-C stops
everything, p2p daemons included.

The swarm's ticket signing key (the one its auth service uses, if started) is created first: the
operator's own workers and trainers sign their tickets with it, and workers serve only its tickets.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from agora_client.auth.identity import write_demo_token_file
from agora_client.auth.tickets import load_or_create_signing_key, load_signing_key, public_key_text
from agora_client.checkpoints.sets import CheckpointError, CheckpointSet, format_time, parse_time, select_set
from agora_client.config import ConfigError, load_config
from agora_client.snapshots import SnapshotError, SnapshotServer, open_store, read_manifest, serve_directory
from agora_client.snapshots.format import MANIFEST_FILE, verify_files
from agora_client.swarm.processes import CLI, ManagedProcess, stop_all
from agora_client.swarm.roles import (
    AUTH_READY,
    MONITOR_READY,
    RELAY_READY,
    SEED_READY,
    WORKER_READY,
    monitor_args,
    relay_args,
    seed_args,
    self_signed_tickets,
    trainer_args,
    worker_args,
)
from agora_client.swarm.roles import auth_args as auth_role_args
from agora_client.system.lifetime import on_signals

RELAY_PORTS = (47000, 47099)  # the ports the local swarm's relay holds for workers
START_TIMEOUT = 180.0


@dataclass
class SwarmOptions:
    preset: str = "tiny"
    workers_per_stage: int = 2
    trainers: int = 1
    run_dir: Path = Path("runs/swarm")
    trainer_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    report_every: float = 5.0
    publish_snapshots: bool = False  # the first worker of each stage publishes snapshots for joiners
    publish_every: int = 2
    checkpoint_store: str | None = None  # the first worker of each stage writes timestamped checkpoints here
    resume: bool = False  # start every stage from the checkpoint set nearest resume_at (None: the newest)
    resume_at: float | None = None
    resume_from: str | None = None  # the store to resume from; default checkpoint_store
    host: str = "127.0.0.1"  # every role listens here (a network namespace's address in the two-host tests)
    worker_tickets: bool = True  # False: workers serve callers without tickets (to measure what the checks cost)


class Placement(Protocol):
    """Where a worker runs: the address it listens on, and the context its process is started in."""

    address: str

    def entered(self) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class SameHost:
    """The default placement: the swarm's own address, started where the launcher runs."""

    address: str

    def entered(self) -> AbstractContextManager[None]:
        return nullcontext()


class LocalSwarm:
    """Starts and stops the processes of a local swarm; usable as a context manager (tests, demo, bench).

    ``place_worker(stage, index)`` may put a worker elsewhere, e.g. on a host of its own in a network
    namespace (tests/netns.py's ``Host`` is a Placement); by default every worker runs on ``options.host``.
    """

    def __init__(
        self,
        options: SwarmOptions,
        on_line: Callable[[str, str], None] | None = None,
        place_worker: Callable[[str, int], Placement] | None = None,
    ):
        self.options, self.on_line = options, on_line
        self.place_worker = place_worker or (lambda stage, index: SameHost(options.host))
        self.config = load_config(options.preset)
        self.seeds: list[ManagedProcess] = []
        self.workers: dict[str, list[ManagedProcess]] = {stage: [] for stage in self.config.model.stage_names}
        self.trainers: list[ManagedProcess] = []
        self.seed_addrs: list[str] = []
        self.auth: ManagedProcess | None = None
        self.relay: ManagedProcess | None = None
        self.monitor: ManagedProcess | None = None
        self.snapshot_server: SnapshotServer | None = None
        self.monitor_url: str | None = None
        self.tokens: dict[str, str] = {}
        self.started_at = time.monotonic()
        self.resume_dirs: dict[str, Path] = {}  # stage -> the checkpoint its workers start from
        self.resume_positions: dict[str, Path] = {}  # trainer shard "i/n" -> the record its data continues from
        load_or_create_signing_key(self.signing_key_path)

    @property
    def signing_key_path(self) -> Path:
        """Where the auth service of this swarm keeps its key (``start_join_services`` uses the same state dir)."""
        return self.options.run_dir / "auth" / "state" / "signing_key.pem"

    @property
    def snapshot_dir(self) -> Path:
        return self.options.run_dir / "snapshots"

    @property
    def processes(self) -> list[ManagedProcess]:
        services = [process for process in (self.monitor, self.auth, self.relay) if process is not None]
        return [*self.trainers, *(w for group in self.workers.values() for w in group), *services, *self.seeds]

    def start_join_services(
        self,
        *,
        pacing: float = 5.0,
        max_workers_per_stage: int = 4,
        monitor: bool = False,
        auth_args: tuple[str, ...] = (),
        users: tuple[str, ...] = ("demo",),
        relay: bool = False,
    ) -> tuple[str, str]:
        """The snapshot store (HTTP) and the auth service with local identities; returns (auth URL, first user's token).

        Every user in ``users`` gets a token (``self.tokens``). With ``monitor``, the points monitor starts
        too and its URL is in the run description the auth service serves (``self.monitor_url``). With
        ``relay``, a relay for workers no port mapping can open starts first and the description lists it.
        """
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self.snapshot_server = serve_directory(self.snapshot_dir, host=self.options.host)
        auth_dir = self.options.run_dir / "auth"
        token_file = auth_dir / "tokens.json"
        self.tokens = {user: write_demo_token_file(token_file, user) for user in users}
        monitor_port = _free_port(self.options.host) if monitor else None
        args = auth_role_args(
            preset=self.options.preset,
            state_dir=self.signing_key_path.parent,
            host=self.options.host,
            seeds=self.seed_addrs,
            snapshot_url=self.snapshot_server.url,
            token_file=token_file,
            pacing=pacing,
            max_workers_per_stage=max_workers_per_stage,
            relays=[self.start_relay()] if relay else [],
            monitor_url=None if monitor_port is None else f"http://{self.options.host}:{monitor_port}",
        )
        self.auth = self._spawn("auth", [*args, *auth_args])
        url = self.auth.wait_for(AUTH_READY, START_TIMEOUT).split()[-1]
        if monitor_port is not None:
            self.start_monitor(url, port=monitor_port)
        return url, self.tokens[users[0]]

    def start_relay(self) -> str:
        """The operator's relay on the swarm's host (ports for workers from RELAY_PORTS up); returns its HOST:PORT."""
        host, port = self.options.host, _free_port(self.options.host)
        auth_public_key = public_key_text(load_signing_key(self.signing_key_path))  # the passes it honours
        self.relay = self._spawn(
            "relay", relay_args(host, port, host, f"{RELAY_PORTS[0]}-{RELAY_PORTS[1]}", auth_public_key)
        )
        self.relay.wait_for(RELAY_READY, START_TIMEOUT)
        return f"{host}:{port}"

    def start_monitor(self, auth_url: str, *, interval: float = 5.0, port: int = 0) -> str:
        """The points monitor, scraping the swarm's signed metrics; returns its base URL."""
        args = monitor_args(
            preset=self.options.preset,
            seeds=self.seed_addrs,
            auth_url=auth_url,
            host=self.options.host,
            db=self.options.run_dir / "monitor" / "points.sqlite",
            port=port,
            interval=interval,
        )
        self.monitor = self._spawn("monitor", args)
        self.monitor_url = self.monitor.wait_for(MONITOR_READY, START_TIMEOUT).split()[-1].removesuffix("/leaderboard")
        return self.monitor_url

    def _spawn(self, name: str, args: list[str], program: Sequence[str] = CLI) -> ManagedProcess:
        return ManagedProcess(
            name, args, self.options.run_dir / "logs" / f"{name}.log", on_line=self.on_line, program=program
        )

    def start_seeds(self, count: int = 2) -> list[str]:
        for index in range(count):
            seed = self._spawn(f"seed{index}", seed_args(self.options.host, self.seed_addrs))
            self.seeds.append(seed)
            self.seed_addrs.append(seed.wait_for(SEED_READY, START_TIMEOUT).split()[-1])
        return self.seed_addrs

    def start_worker(self, stage: str, *extra: str, wait: bool = True, program: Sequence[str] = CLI) -> ManagedProcess:
        """A worker of ``stage`` with the swarm's arguments and ``extra``, run by ``program`` (default: ``agora``)."""
        index = len(self.workers[stage])
        placement = self.place_worker(stage, index)
        (self.options.run_dir / "events").mkdir(parents=True, exist_ok=True)
        publishing = self.options.publish_snapshots
        args = worker_args(
            stage=stage,
            index=index,
            preset=self.options.preset,
            host=placement.address,
            seeds=self.seed_addrs,
            ticket_key=self.signing_key_path if self.options.worker_tickets else None,
            events=self.options.run_dir / "events" / f"{stage}-{index}.jsonl",
            recover_from=self.snapshot_dir if publishing else None,
            publish_to=str(self.snapshot_dir) if publishing and index == 0 else None,
            publish_every=self.options.publish_every,
            checkpoints=self.options.checkpoint_store if index == 0 else None,
            snapshot=self.resume_dirs.get(stage),
        )
        with placement.entered():  # the worker and its daemons start where it is placed (e.g. a network namespace)
            worker = self._spawn(f"{stage}-{index}", [*args, *self.options.worker_args, *extra], program)
        self.workers[stage].append(worker)
        if wait:
            worker.wait_for(WORKER_READY, START_TIMEOUT)
        return worker

    def start_trainer(self, *extra: str) -> ManagedProcess:
        index = len(self.trainers)
        shard = f"{index}/{max(self.options.trainers, index + 1)}"
        args = trainer_args(
            preset=self.options.preset,
            host=self.options.host,
            seeds=self.seed_addrs,
            shard=shard,
            tickets=self_signed_tickets(self.signing_key_path),
            report_every=self.options.report_every,
            checkpoints=self.options.checkpoint_store,
            resume_position=self.resume_positions.get(shard),
        )
        trainer = self._spawn(f"trainer{index}", [*args, *self.options.trainer_args, *extra])
        self.trainers.append(trainer)
        return trainer

    def prepare_resume(self) -> CheckpointSet:
        """Pick the checkpoint set to resume from and fetch it locally; CheckpointError says what is wrong."""
        location = self.options.resume_from or self.options.checkpoint_store
        if not location:
            raise CheckpointError("resuming needs a checkpoint store: pass --checkpoints or --resume-from")
        store = open_store(location)
        checkpoints = select_set(store, self.options.resume_at)
        checkpoints.check_config(self.config)
        cache = self.options.run_dir / "resume"
        resume_dirs = {}
        for stage, snapshot in checkpoints.members.items():
            directory = store.local_dir(snapshot, cache)
            try:
                verify_files(directory, read_manifest(directory / MANIFEST_FILE))
            except SnapshotError as error:
                raise CheckpointError(f"stage {stage}, checkpoint {snapshot.name}: {error}") from None
            resume_dirs[stage] = directory
        self.resume_dirs = resume_dirs
        self.resume_positions = self._resume_positions(checkpoints, cache)
        return checkpoints

    def _resume_positions(self, checkpoints: CheckpointSet, cache: Path) -> dict[str, Path]:
        """Each trainer's record in the set, written where its trainer reads it; the trainer count must match."""
        counts = {shard.split("/")[1] for shard in checkpoints.trainers}
        if counts and counts != {str(self.options.trainers)}:
            raise CheckpointError(
                f"the set's data positions are for {', '.join(sorted(counts))} trainer(s), this swarm "
                f"starts {self.options.trainers}: resume with --trainers {min(counts)} so that no data repeats"
            )
        positions = {}
        for shard, record in checkpoints.trainers.items():
            path = cache / f"trainer-{shard.replace('/', '-of-')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record), encoding="utf-8")
            positions[shard] = path
        return positions

    def start(self, beside_workers: Callable[[], object] | None = None) -> "LocalSwarm":
        """Seeds, then workers, then trainers. ``beside_workers`` (roles that need the seeds but not the workers:
        the auth service, the monitor) runs once the seeds are up, while the workers build."""
        self.started_at = time.monotonic()
        if self.options.resume and not self.resume_dirs:
            self.prepare_resume()
        self.start_seeds()
        launching = []
        for stage in self.config.model.stage_names:
            for _ in range(self.options.workers_per_stage):
                launching.append(self.start_worker(stage, wait=False))
        if beside_workers is not None:
            beside_workers()
        for worker in launching:
            worker.wait_for(WORKER_READY, START_TIMEOUT)
        for _ in range(self.options.trainers):
            self.start_trainer()
        return self

    def stop(self) -> None:
        stop_all(self.processes)
        if self.snapshot_server is not None:
            self.snapshot_server.close()

    def leftover_pids(self) -> list[int]:
        return [pid for process in self.processes for pid in process.group_pids()]

    def __enter__(self) -> "LocalSwarm":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    """A port free on ``host`` right now (for a role whose URL must be known before it starts)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="run config preset (default: tiny)")
    parser.add_argument("--workers-per-stage", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/swarm"), help="logs and events go here")
    parser.add_argument("--report-every", type=float, default=5.0, help="seconds between loss lines")
    parser.add_argument(
        "--checkpoints",
        default=None,
        metavar="STORE",
        help="checkpoint store, a directory or s3://bucket/prefix (default: <run-dir>/checkpoints)",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true", help="start every stage from the newest checkpoint set")
    resume.add_argument(
        "--resume-at",
        default=None,
        metavar="T",
        help="start every stage from its checkpoint nearest T (ISO 8601 UTC or unix seconds)",
    )
    parser.add_argument(
        "--resume-from", default=None, metavar="STORE", help="store to resume from (default: --checkpoints)"
    )


def run(args: argparse.Namespace) -> int:
    """Start a whole swarm from the command line and keep it up until Ctrl-C or a trainer exits; the exit code."""
    try:
        resume_at = None if args.resume_at is None else parse_time(args.resume_at)
    except CheckpointError as error:
        print(f"[ERROR] --resume-at: {error}")
        return 2
    options = _options_from_args(args, resume_at)
    try:
        swarm = LocalSwarm(options, on_line=_relay_trainer_line)
    except ConfigError as error:
        print(f"[ERROR] {error}")
        return 2
    stop = _event_set_on_stop_signals()
    print(
        f"[SWARM] starting {options.preset}: 2 seeds, {options.workers_per_stage} workers per stage, "
        f"{options.trainers} trainer(s); logs in {options.run_dir / 'logs'}",
        flush=True,
    )
    try:
        return _start_and_watch(swarm, stop)
    except (CheckpointError, SnapshotError) as error:
        print(f"[ERROR] cannot resume: {error}", flush=True)
        return 2
    except RuntimeError as error:
        print(f"[ERROR] {error}", flush=True)
        return 1
    finally:
        _stop_swarm(swarm)


def _options_from_args(args: argparse.Namespace, resume_at: float | None) -> SwarmOptions:
    return SwarmOptions(
        preset=args.preset,
        workers_per_stage=args.workers_per_stage,
        trainers=args.trainers,
        run_dir=args.run_dir,
        report_every=args.report_every,
        checkpoint_store=args.checkpoints or str(args.run_dir / "checkpoints"),
        resume=args.resume or resume_at is not None,
        resume_at=resume_at,
        resume_from=args.resume_from,
    )


def _relay_trainer_line(name: str, line: str) -> None:
    """Show the trainers' progress, warnings and errors on the console; everything else stays in the logs."""
    if name.startswith("trainer") and line.startswith(("[PROGRESS]", "[WARNING]", "[ERROR]", "[TRAINER]")):
        print(f"{name}: {line}", flush=True)


def _event_set_on_stop_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set."""
    stop = threading.Event()
    on_signals((signal.SIGINT, signal.SIGTERM), stop.set)
    return stop


def _start_and_watch(swarm: LocalSwarm, stop: threading.Event) -> int:
    """Start the swarm (from checkpoints if asked), then wait for ``stop``: 0, or 1 as soon as a trainer exits."""
    if swarm.options.resume:
        checkpoints = swarm.prepare_resume()
        for stage, snapshot in checkpoints.members.items():
            print(
                f"[SWARM] {stage} resumes from {snapshot.name} (epoch {snapshot.epoch}, "
                f"{format_time(snapshot.timestamp)})",
                flush=True,
            )
        for shard, record in sorted(checkpoints.trainers.items()):
            print(f"[SWARM] trainer {shard} continues its data from {format_time(record['timestamp'])}", flush=True)
        if not checkpoints.trainers:
            print(
                "[SWARM] the set holds no trainer data positions: the trainers start their data from the beginning",
                flush=True,
            )
    swarm.start()
    print(
        f"[SWARM] all workers up after {time.monotonic() - swarm.started_at:.1f}s; seeds: {' '.join(swarm.seed_addrs)}",
        flush=True,
    )
    print("[SWARM] press Ctrl-C to stop", flush=True)
    while not stop.wait(1.0):
        if not all(trainer.alive for trainer in swarm.trainers):
            print("[ERROR] a trainer exited; see its log", flush=True)
            return 1
    return 0


def _stop_swarm(swarm: LocalSwarm) -> None:
    """Stop every process and say whether any outlived the stop."""
    print("[SWARM] stopping every process...", flush=True)
    swarm.stop()
    left = swarm.leftover_pids()
    print(f"[SWARM] stopped{'' if not left else f'; processes still running: {left}'}", flush=True)
