#!/usr/bin/env python3
"""Pipeline tokens/s of one stage served through the operator's relay against the same stage served directly,
on the same shaped home-like uplink, and the latency the relay adds to each request.

Two hosts: network namespaces on a bridge (tests/netns.py BridgedHosts; needs root and tc). Host 0 is the
operator's: the seeds, the relay (`agora relay`), the trainer and the workers of every other stage. Host 1 is
the home of the measured stage's one worker (``--stage``, body1), whose uplink is shaped with ``tc ... tbf``
to a home rate scaled to tiny like bench/home_link.py does: ``--home-mbit`` (50) times tiny's over 8b's
compressed boundary bytes per token (`agora describe`). Served directly, the worker listens on host 1's
address; served through the relay (``agora worker --relay``), it listens on 127.0.0.1 and announces only the
port the relay holds for it, so every request crosses host 1's uplink to the relay and the relay's hop on to
the trainer. libp2p reuses any connection between two peers, and a worker that dialed the trainer's DHT peer
itself (storing its roster record) would be served over that connection instead: so host 1 opens TCP
connections to host 0 only to the seeds and the relay's control port (nftables; in both phases alike).
One worker per stage, so the measured stage's path is the whole pipeline's.

1. Latency, before the trainer starts (link and workers otherwise idle): both workers of the stage up at once,
   the bench's own DHT peer on host 0 sends each ``--probes`` forward calls of one microbatch (what the trainer
   sends: the boundary the stages before it computed, with the trainer's ticket), alternating between the
   two; the median time per call of each, and relayed minus direct is the added latency per request.
2. Tokens/s from the trainer's [PROGRESS] lines in phases relayed, direct, direct, relayed (ABBA: a drift of
   the machine's load that is linear in time falls on both alike); the middle two are one phase twice as
   long. Between phases the next worker starts, the trainer is given until it routes to it, then the previous
   one stops; the microbatches in flight finish unmeasured (``--warmup``), then each phase lasts at least
   ``--seconds`` and six whole microbatches. Each phase checks that only its worker served the stage.
3. The relay's own count of the bytes it carried for the last relayed worker (its log, when the worker gives
   the port back) over the bytes per token the trainer counted for the stage ([TRAFFIC]) times the tokens
   that worker served (``relayed_bytes_ratio``): about 1 or a little more (libp2p's framing, DHT requests,
   requests that failed at the hand-over) when the stage's traffic crossed the relay, near 0 when it did not.

``ratio`` = relayed / direct tokens/s; target >= 0.8 (``meets_target``).

    python bench/relay_link.py                   # as root; ~8 min on 2 cores
    python bench/relay_link.py --seconds 15 --probes 8 --warmup 5     # ~4 min
    python bench/relay_link.py --home-mbit 5      # a home link that limits throughput

Every namespace, qdisc, process and the relay go on exit, on failure, Ctrl-C and SIGTERM too.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the namespace helpers live in tests/netns.py

from _trainer_progress import ProgressRecorder, served_by, tokens_per_second  # noqa: E402
from home_link import (  # noqa: E402
    MEASURED_MICROBATCHES,
    PRESET,
    REFERENCE,
    REPORT_EVERY,
    bytes_per_token,
    link_tokens_per_s,
    wait_for_microbatches,
    wait_for_progress,
)

from agora_client.auth.ticket_source import SelfIssuedTickets  # noqa: E402
from agora_client.discovery.dht import connect_dht  # noqa: E402
from agora_client.discovery.roster import WorkerRecord, fetch_roster  # noqa: E402
from agora_client.swarm.launcher import START_TIMEOUT, WORKER_READY, LocalSwarm, SwarmOptions  # noqa: E402
from agora_client.swarm.processes import ManagedProcess  # noqa: E402
from agora_client.trainer.rpc import StageClient, TrafficCounter  # noqa: E402
from tests.netns import BridgedHosts, Host, unavailable  # noqa: E402

TARGET_RATIO = 0.8
LINK_BINDS_ABOVE = (
    0.7  # direct tokens/s above this share of what the shaped uplink carries: the link limits, not the CPUs
)
HANDOVER_S = 30.0  # how long a new worker is given to serve before the one it replaces stops anyway
ROSTER_TIMEOUT = 60.0
RELAY_SERVES = re.compile(r"serving through the relay \S+: the swarm reaches this worker at (\S+),")
RELAY_RELEASED = re.compile(r"released (\S+) for .*?: held \d+ s, (\d+) bytes relayed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", default="body1", help="the stage served from the home host (default: body1)")
    parser.add_argument(
        "--home-mbit",
        type=float,
        default=50.0,
        help="home uplink (Mbit/s) whose 8b compressed traffic is scaled onto tiny's (default: 50)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=45.0,
        help=f"measured seconds per phase (direct twice that; longer until {MEASURED_MICROBATCHES} "
        "microbatches finished)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="seconds after each worker change not measured (longer until the microbatches in flight finished)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=180.0, help="longest a warm-up or a measurement waits for its microbatches"
    )
    parser.add_argument("--probes", type=int, default=20, help="timed forward calls per worker for the latency")
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight in the trainer")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args()
    if min(args.home_mbit, args.seconds, args.warmup + 1, args.max_seconds, args.probes, args.inflight) <= 0:
        parser.error("use positive rates, durations and counts")
    return args


class Watcher:
    """``on_line`` for the swarm: the trainer's progress (a ProgressRecorder) and its last [TRAFFIC] figures."""

    def __init__(self) -> None:
        self.progress = ProgressRecorder()
        self.traffic: dict[str, float] = {}

    def __call__(self, name: str, line: str) -> None:
        self.progress(name, line)
        if name.startswith("trainer") and line.startswith("[TRAFFIC] "):
            self.traffic = json.loads(line.removeprefix("[TRAFFIC] "))


class Prober:
    """The bench's own DHT peer and stage client on the operator's host: times forward calls to chosen workers."""

    def __init__(self, swarm: LocalSwarm, host: Host):
        self.swarm = swarm
        tickets = SelfIssuedTickets.from_file(swarm.signing_key_path, role="trainer", stage="trainer")
        with host.entered():  # the DHT's process and its p2p daemon live on the operator's host
            self.dht = connect_dht(swarm.seed_addrs, host=host.address)
            self.client = StageClient("probe", self.dht, TrafficCounter(), timeout=60.0, tickets=tickets)

    def close(self) -> None:
        self.client.close()
        self.dht.shutdown()

    def record(self, stage: str, uid: str) -> WorkerRecord:
        """The roster record of worker ``uid`` of ``stage``, once it is there and routable."""
        deadline = time.monotonic() + ROSTER_TIMEOUT
        while time.monotonic() < deadline:
            for record in fetch_roster(self.dht, stage).values():
                if record.uid == uid and record.routable:
                    return record
            time.sleep(1.0)
        raise RuntimeError(f"{uid} did not appear in the roster of {stage} within {ROSTER_TIMEOUT:.0f}s")

    def stage_inputs(self, stage: str) -> tuple[torch.Tensor, ...]:
        """What the trainer sends ``stage`` for one microbatch: the stages before it run on their first workers."""
        config = self.swarm.config
        batch = torch.randint(0, config.model.vocab_size, (config.optim.microbatch_size, config.model.seq_len + 1))
        tokens, labels = batch[:, :-1], batch[:, 1:]
        boundary = None
        for name in config.model.stage_names:
            inputs = (
                (tokens,) if name == "head" else (boundary, tokens, labels) if name == "tail" else (boundary, tokens)
            )
            if name == stage:
                return inputs
            boundary = self.client.forward(self.record(name, f"{name}.0.0"), inputs)[0]
        raise ValueError(f"no stage {stage!r} in the preset")

    def time_forward(self, record: WorkerRecord, inputs: tuple[torch.Tensor, ...]) -> float:
        started = time.perf_counter()
        self.client.forward(record, inputs)
        return time.perf_counter() - started


def probe_latency(prober: Prober, stage: str, uids: dict[str, str], count: int) -> dict[str, list[float]]:
    """Seconds per forward call of each worker (path -> uid), the calls alternating; one untimed call each first."""
    records = {path: prober.record(stage, uid) for path, uid in uids.items()}
    inputs = prober.stage_inputs(stage)
    for record in records.values():
        prober.time_forward(record, inputs)  # opens the connection: not what a request costs once it is open
    times: dict[str, list[float]] = {path: [] for path in records}
    for _ in range(count):
        for path, record in records.items():
            times[path].append(prober.time_forward(record, inputs))
    return times


def ready_uid(worker: ManagedProcess) -> str:
    """The uid in the worker's ``[WORKER] <uid> ready on peer ...`` line."""
    return worker.wait_for(WORKER_READY, START_TIMEOUT).split()[1]


def start_worker(swarm: LocalSwarm, stage: str, relay: str | None) -> tuple[ManagedProcess, str]:
    """A worker of ``stage`` on its home host, served through ``relay`` or directly; (process, uid) once ready."""
    extra = ("--relay", relay, "--host", "127.0.0.1") if relay is not None else ()
    worker = swarm.start_worker(stage, *extra)
    return worker, ready_uid(worker)


def hand_over(
    swarm: LocalSwarm, watcher: Watcher, stage: str, old: ManagedProcess, relay: str | None
) -> tuple[ManagedProcess, str]:
    """Start the next worker of ``stage``, give the trainer until it routes to it, then stop ``old``."""
    worker, uid = start_worker(swarm, stage, relay)
    since = time.monotonic()
    trainer = swarm.trainers[0].name
    while time.monotonic() < since + HANDOVER_S:
        if served_by([p for p in watcher.progress.of(trainer) if p.at >= since], stage).get(uid):
            break
        time.sleep(0.5)
    old.stop()
    return worker, uid


def measure(
    swarm: LocalSwarm, watcher: Watcher, stage: str, uid: str, seconds: float, args: argparse.Namespace
) -> dict:
    """Tokens/s once the microbatches in flight at the change have finished, and who served the stage meanwhile."""
    recorder = watcher.progress
    wait_for_microbatches(swarm, recorder, args.warmup, args.inflight, args)
    measured_from = time.monotonic()
    wait_for_microbatches(swarm, recorder, seconds, MEASURED_MICROBATCHES, args)
    points = [point for point in recorder.of(swarm.trainers[0].name) if point.at >= measured_from]
    served = {worker for worker, requests in served_by(points, stage).items() if requests}
    if served - {uid}:
        raise RuntimeError(f"{stage} was served by {sorted(served)} while only {uid} should have; see the logs")
    tokens = swarm.config.optim.microbatch_size * swarm.config.model.seq_len
    return {
        "uid": uid,
        "tokens_per_s": round(tokens_per_second(points, tokens), 1),
        "measured_s": round(time.monotonic() - measured_from, 1),
    }


def released_bytes(relay: ManagedProcess, address: str, before: int) -> int:
    """Bytes the relay carried for the reservation of ``address`` it releases next (``before`` lines already read;
    a port is handed out again once released)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for line in relay.lines()[before:]:
            if (match := RELAY_RELEASED.search(line)) and match.group(1) == address:
                return int(match.group(2))
        time.sleep(0.5)
    raise RuntimeError(f"the relay did not release {address} within {START_TIMEOUT:.0f}s; see {relay.log_path}")


def relayed_share(swarm: LocalSwarm, watcher: Watcher, stage: str, worker: ManagedProcess, uid: str) -> dict:
    """Stop the relayed ``worker`` and compare the bytes the relay carried for it with the stage's traffic."""
    address = RELAY_SERVES.search(worker.wait_for("serving through the relay", START_TIMEOUT)).group(1)
    served = served_by(watcher.progress.of(swarm.trainers[0].name), stage).get(uid, 0)
    before = len(swarm.relay.lines())
    worker.stop()
    relayed = released_bytes(swarm.relay, address, before)
    per_token = sum(value for key, value in watcher.traffic.items() if key.startswith(f"{stage}."))
    tokens = (
        served / 2 * swarm.config.optim.microbatch_size * swarm.config.model.seq_len
    )  # a forward and a backward each
    expected = per_token * tokens
    return {
        "relayed_mbytes": round(relayed / 1e6, 2),
        "stage_mbytes": round(expected / 1e6, 2),
        "relayed_bytes_ratio": round(relayed / expected, 2) if expected else None,
    }


def port_of(address: str) -> int:
    """The TCP port of a seed's multiaddr (``/ip4/H/tcp/P/p2p/ID``) or of a ``host:port``."""
    return int(address.split("/tcp/")[1].split("/")[0]) if "/tcp/" in address else int(address.rpartition(":")[2])


def let_out_only(home: Host, operator: str, ports: list[int]) -> None:
    """The home host refuses to open TCP connections to the operator's host but to ``ports`` (the seeds and the
    relay). libp2p reuses any connection between two peers: a relayed worker that dialed the trainer's DHT peer
    itself (to store its roster record) would be served over that connection, not through the relay. The table
    goes with the namespace."""
    table = "agora_relay_link"
    allowed = "{ " + ", ".join(str(port) for port in ports) + " }"
    home.run("nft", "add", "table", "inet", table)
    home.run("nft", "add", "chain", "inet", table, "output", "{ type filter hook output priority 0; policy accept; }")
    home.run(
        "nft",
        "add",
        "rule",
        "inet",
        table,
        "output",
        "ip",
        "daddr",
        operator,
        "tcp",
        "dport",
        "!=",
        allowed,
        "ct",
        "state",
        "new",
        "reject",
        "with",
        "tcp",
        "reset",
    )


def run(args: argparse.Namespace, hosts: BridgedHosts, mbit: float, run_dir: Path) -> dict:
    """Start the swarm, time the probes, measure the phases; every figure of the JSON line but the link's."""
    operator, home = hosts[0], hosts[1]
    watcher = Watcher()
    options = SwarmOptions(
        preset=PRESET,
        workers_per_stage=1,
        trainers=0,
        run_dir=run_dir,
        report_every=REPORT_EVERY,
        trainer_args=("--inflight", str(args.inflight)),
        host=operator.address,
    )
    swarm = LocalSwarm(
        options, on_line=watcher, place_worker=lambda stage, index: home if stage == args.stage else operator
    )
    try:
        with operator.entered():  # seeds, relay and the other stages' workers; the measured stage's goes home
            swarm.start()
            relay = swarm.start_relay()
        home.shape_uplink(mbit)
        let_out_only(home, operator.address, [port_of(address) for address in (*swarm.seed_addrs, relay)])
        print(
            f"swarm up after {time.monotonic() - swarm.started_at:.0f}s, relay {relay}; logs in {run_dir / 'logs'}",
            flush=True,
        )
        direct, relayed = swarm.workers[args.stage][0], start_worker(swarm, args.stage, relay)
        latency = timed_probes(args, swarm, operator, {"direct": ready_uid(direct), "relayed": relayed[1]})
        direct.stop()
        with operator.entered():
            swarm.start_trainer()
        wait_for_progress(swarm, watcher.progress)
        phases = measure_phases(args, swarm, watcher, relay, relayed)
        return {
            "latency": latency,
            "phases": phases[0],
            "relay_traffic": relayed_share(swarm, watcher, args.stage, *phases[1]),
        }
    finally:
        swarm.stop()
        home.unshape_uplink()


def timed_probes(args: argparse.Namespace, swarm: LocalSwarm, operator: Host, uids: dict[str, str]) -> dict:
    prober = Prober(swarm, operator)
    try:
        times = probe_latency(prober, args.stage, uids, args.probes)
    finally:
        prober.close()
    latency = {
        path: {
            "median_ms": round(statistics.median(seconds) * 1000, 1),
            "p90_ms": round(sorted(seconds)[int(0.9 * (len(seconds) - 1))] * 1000, 1),
        }
        for path, seconds in times.items()
    }
    for path, figures in latency.items():
        print(
            f"forward of one microbatch to the {path} worker ({uids[path]}): median {figures['median_ms']} ms, "
            f"p90 {figures['p90_ms']} ms over {args.probes} calls",
            flush=True,
        )
    return latency


def measure_phases(
    args: argparse.Namespace, swarm: LocalSwarm, watcher: Watcher, relay: str, relayed: tuple[ManagedProcess, str]
) -> tuple[list[dict], tuple[ManagedProcess, str]]:
    """Relayed, direct (twice as long), relayed; the figures of each, and the last relayed worker (still up)."""
    stage, worker, uid = args.stage, *relayed
    phases = []
    for path in ("relayed", "direct", "relayed"):
        if phases:
            worker, uid = hand_over(swarm, watcher, stage, worker, relay if path == "relayed" else None)
        seconds = args.seconds * (2 if path == "direct" else 1)
        phase = {"path": path, **measure(swarm, watcher, stage, uid, seconds, args)}
        phases.append(phase)
        print(
            f"  {path:8s} {uid:10s} {phase['tokens_per_s']:8.1f} tokens/s over {phase['measured_s']:.0f}s", flush=True
        )
    return phases, (worker, uid)


def summary(args: argparse.Namespace, mbit: float, link_capacity: float, result: dict) -> dict:
    phases, latency = result["phases"], result["latency"]
    direct = statistics.mean(p["tokens_per_s"] for p in phases if p["path"] == "direct")
    relayed = statistics.mean(p["tokens_per_s"] for p in phases if p["path"] == "relayed")
    ratio = relayed / direct if direct > 0 else 0.0
    added = latency["relayed"]["median_ms"] - latency["direct"]["median_ms"]
    return {
        "bench": "relay_link",
        "preset": PRESET,
        "stage": args.stage,
        "home_mbit": args.home_mbit,
        "rate_mbit": round(mbit, 3),
        "link_tokens_per_s": round(link_capacity),
        "link_binds": direct >= LINK_BINDS_ABOVE * link_capacity,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "tokens_per_s_direct": round(direct, 1),
        "tokens_per_s_relayed": round(relayed, 1),
        "ratio": round(ratio, 3),
        "request_latency_ms_direct": latency["direct"]["median_ms"],
        "request_latency_ms_relayed": latency["relayed"]["median_ms"],
        "added_latency_ms": round(added, 1),
        "latency_p90_ms": {path: figures["p90_ms"] for path, figures in latency.items()},
        "phases": phases,
        **result["relay_traffic"],
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
    }


def main() -> int:
    args = parse_args()
    if reason := unavailable(firewall=True, shaping=True):
        raise SystemExit(f"the home host needs a network namespace: {reason}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
    tiny, big = bytes_per_token(PRESET), bytes_per_token(REFERENCE)
    mbit = args.home_mbit * tiny["compressed"] / big["compressed"]
    capacity = link_tokens_per_s(mbit, tiny["compressed"], 1)
    print(
        f"{REFERENCE} compressed ({big['compressed']:,} B/token) on a {args.home_mbit:g} Mbit/s home uplink spends as "
        f"long per token on the link as {PRESET} ({tiny['compressed']:,} B/token) at {mbit:.2f} Mbit/s: the home "
        f"uplink alone carries at most ~{capacity:,.0f} tokens/s of {args.stage}",
        flush=True,
    )
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-relay-link-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    with BridgedHosts(f"agrl-{os.getpid()}", 2) as hosts:
        result = run(args, hosts, mbit, run_dir)
    figures = summary(args, mbit, capacity, result)
    print(
        f"tokens/s direct {figures['tokens_per_s_direct']}, relayed {figures['tokens_per_s_relayed']}: ratio "
        f"{figures['ratio']} (target >= {TARGET_RATIO}: {'met' if figures['meets_target'] else 'NOT met'}); "
        f"a request takes {figures['added_latency_ms']} ms more through the relay; the relay carried "
        f"{figures['relayed_bytes_ratio']} x the stage's traffic the trainer counted; the shaped uplink "
        f"{'limits throughput' if figures['link_binds'] else 'does not limit throughput: the CPUs do'}",
        flush=True,
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
