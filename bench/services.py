"""Whether the auth service holds up against slow clients and a storm of joins (issue 28, "services that hold up").

A real auth service (token file identities, its default limits) runs in a process of its own on 127.0.0.1.
An honest client in this process times GET /v1/status from 127.0.0.1, each request on a fresh connection
(one every `--every-s`, for `--seconds` per phase): at baseline (three stretches, pooled, one before each
other phase, so that they meet the same machine load); while an attacker process holds 1,000 and then 5,000
half-open connections from 127.0.0.2 (each sends a request line, then one header line every `--trickle-s`
seconds, and is opened again as soon as the service closes it); and while a storm process sends `--joins`
valid joins (one identity each) from `--join-sources` addresses 127.0.1.x, `--storm-threads` at a time.

Every address is loopback here, and the service leaves loopback clients out of its rate limits (a local swarm
joins many workers from 127.0.0.1): this bench switches that exemption off, keeping the limits' rates, so that
the storm meets the limits an internet client would. A join refused by a rate limit (429) is counted apart
(`rate_limited`), not as a failure; joins_per_s counts the joins the service answered (authorized or queued).

Figures: p50 / p99 of each phase in ms, `p99_ratio_1000`, `p99_ratio_5000` and `p99_ratio_storm` (over the
baseline's p99; target <= 2), `honest_failures` (any honest request not answered 200 within 10 s; target 0),
the attacker's connections open when the honest requests ran and how many it had to open again.

CPUs: the attacker and the storm stand for other machines, so on a machine with two CPUs or more they run on
CPUs of their own (every CPU but the first), and the service and the honest client share the first, in every
phase alike: the figures then show what the attack costs the service (accepting, reading and cutting its
connections), not what running the attacker costs this machine. `--no-pin` runs every process on every CPU.

`--firewall` (root, nftables) puts the kernel's per-address limit of `agora deploy firewall` in front of the
service for the whole run: the bench moves itself into a network namespace of its own (so the rules touch
nothing else on this machine), loads the same ruleset there for the service's port, and removes it at the end
(also on Ctrl-C). The kernel then drops the SYNs of an address that opens more than the guard's per-address cap
at once and 3,000 a minute (50 a second) after that, before they reach accept(): the attacker still holds the cap, but
its reconnections no longer cost the service an accept and a close each. 127.0.0.1 is not exempt: the honest client
stands for many clients on addresses of their own, and opens 20 connections a second. An attacker's connect that gets no
answer within `OPEN_TIMEOUT_S` counts as an open failure, so that its refills keep their pace.

Usage: python bench/services.py [--seconds 15] [--slow 1000,5000] [--joins 200] [--no-pin] [--firewall]
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository
from agora_client.auth import (  # noqa: E402
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    write_demo_token_file,
)
from agora_client.auth.server import JOIN_RATE, POLL_RATE  # noqa: E402
from agora_client.deploy.firewall import (
    DEFAULT_BURST,
    DEFAULT_PER_MINUTE,
    apply_ruleset,
    remove_ruleset,
    render_ruleset,
)  # noqa: E402

HONEST_TIMEOUT_S = 10.0
OPEN_TIMEOUT_S = 3.0  # an attacker's connect whose SYN the kernel dropped: given up, as a real attacker would
CLONE_NEWNET = 0x40000000
CONTEXT = mp.get_context("fork")


def pin(cpus: set[int] | None) -> None:
    """Run this process on ``cpus`` only (None: wherever the kernel likes)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def serve(state: Path, conn, cpus: set[int] | None) -> None:
    """The auth service under test, in its own process; the loopback exemption off (see the docstring)."""
    pin(cpus)
    settings = ServiceSettings(
        policy=AdmissionPolicy(
            stages=("head", "body1", "tail"), max_workers_per_stage=100, pacing_s=0.0, max_pending_per_stage=100
        )
    )
    service = AuthService(settings, TokenFileIdentity(state / "tokens.json"), state / "service")
    server = AuthServer(
        service,
        join_rate=dataclasses.replace(JOIN_RATE, exempt_loopback=False),
        poll_rate=dataclasses.replace(POLL_RATE, exempt_loopback=False),
    )
    with server:
        conn.send(server.url)
        conn.recv()


def honest_request(host: str, port: int) -> float | None:
    """Seconds for one GET /v1/status on a fresh connection from 127.0.0.1; None if it failed."""
    started = time.perf_counter()
    try:
        with socket.create_connection(
            (host, port), timeout=HONEST_TIMEOUT_S, source_address=("127.0.0.1", 0)
        ) as client:
            client.sendall(f"GET /v1/status HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
    except OSError:
        return None
    return time.perf_counter() - started if answer.startswith(b"HTTP/1.1 200") else None


def measure(host: str, port: int, seconds: float, every_s: float, until=None) -> dict:
    """Honest requests, one every ``every_s``, for ``seconds`` (with ``until``: also until it says True)."""
    times, failures, started = [], 0, time.monotonic()
    next_at = started
    while time.monotonic() - started < seconds or (until is not None and not until()):
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at += every_s
        took = honest_request(host, port)
        if took is None:
            failures += 1
        else:
            times.append(took)
    return {"times": times, "failures": failures}


def summary(measured: dict, label: str) -> dict:
    times = measured["times"]
    figures = {"requests": len(times) + measured["failures"], "failures": measured["failures"]}
    if len(times) >= 2:
        figures.update(
            p50_ms=round(statistics.median(times) * 1e3, 2),
            p99_ms=round(statistics.quantiles(times, n=100, method="inclusive")[98] * 1e3, 2),
        )
    print(f"{label:>12s}: {figures}", flush=True)
    return figures


# -- the attacker: half-open connections that each trickle one header line every few seconds ---------------


def attack(host: str, port: int, connections: int, trickle_s: float, conn, cpus: set[int] | None) -> None:
    pin(cpus)
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    asyncio.run(_attack(host, port, connections, trickle_s, conn))


async def _attack(host: str, port: int, connections: int, trickle_s: float, conn) -> None:
    loop = asyncio.get_running_loop()
    writers: list[asyncio.StreamWriter | None] = [None] * connections
    stats = {"opened": 0, "open_failures": 0, "open_at_report": 0}
    stop = asyncio.Event()
    loop.add_reader(conn.fileno(), stop.set)  # the bench writes "stop"

    async def open_one(index: int) -> None:
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0)), OPEN_TIMEOUT_S
            )
            writer.write(f"GET /v1/status HTTP/1.1\r\nHost: {host}\r\n".encode())
            writers[index] = writer
            stats["opened"] += 1
        except (OSError, asyncio.TimeoutError):
            stats["open_failures"] += 1

    async def refill() -> None:
        missing = [index for index, writer in enumerate(writers) if writer is None or writer.is_closing()]
        for start in range(0, len(missing), 500):  # in batches: the listen backlog is finite
            await asyncio.gather(*(open_one(index) for index in missing[start : start + 500]))

    await refill()
    first_round = True
    while not stop.is_set():
        await asyncio.sleep(trickle_s)
        for writer in writers:
            if writer is not None and not writer.is_closing():
                writer.write(b"X-Trickle: 1\r\n")
        await asyncio.sleep(0)
        open_now = sum(writer is not None and not writer.is_closing() for writer in writers)
        if first_round:
            stats["open_at_report"] = open_now
            conn.send(dict(stats))  # holding: the honest requests may start
            first_round = False
        await refill()
    conn.recv()
    for writer in writers:
        if writer is not None:
            writer.transport.abort()
    conn.send(dict(stats))


class Attacker:
    def __init__(self, host: str, port: int, connections: int, trickle_s: float, cpus: set[int] | None):
        self._conn, child = CONTEXT.Pipe()
        self._process = CONTEXT.Process(
            target=attack, args=(host, port, connections, trickle_s, child, cpus), daemon=True
        )
        self._process.start()
        self.holding = self._conn.recv()

    def stop(self) -> dict:
        self._conn.send("stop")
        stats = self._conn.recv() if self._conn.poll(60) else {}
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
        return stats


# -- the storm of joins -----------------------------------------------------------------------------------


def storm(url: str, tokens: list[str], sources: int, threads: int, conn, cpus: set[int] | None) -> None:
    pin(cpus)

    def join(index: int) -> int:
        source = f"127.0.1.{1 + index % sources}"
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
            try:
                return client.post(
                    f"{url}/v1/join", json={"token": tokens[index], "peer_id": f"peer{index}"}
                ).status_code
            except httpx.HTTPError:
                return -1

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        codes = list(pool.map(join, range(len(tokens))))
    conn.send((codes, time.perf_counter() - started))


def run_storm(url: str, host: str, port: int, tokens: list[str], args, cpus: set[int] | None) -> tuple[dict, dict]:
    conn, child = CONTEXT.Pipe()
    process = CONTEXT.Process(
        target=storm, args=(url, tokens, args.join_sources, args.storm_threads, child, cpus), daemon=True
    )
    process.start()
    honest = summary(measure(host, port, 1.0, args.every_s, until=conn.poll), "join storm")
    codes, duration = conn.recv()
    process.join(10)
    served = sum(code == 200 for code in codes)
    joins = {
        "joins_served": served,
        "rate_limited": codes.count(429),
        "join_failures": len(codes) - served - codes.count(429),
        "storm_s": round(duration, 2),
        "joins_per_s": round(served / duration, 1),
    }
    print(f"{'join storm':>12s}: {joins}, answers {dict(sorted(Counter(codes).items()))}", flush=True)
    return honest, joins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase's honest requests")
    parser.add_argument("--every-s", type=float, default=0.05, help="seconds between honest requests")
    parser.add_argument("--slow", default="1000,5000", help="half-open connections held, one phase each")
    parser.add_argument("--trickle-s", type=float, default=5.0, help="seconds between an attacker's header lines")
    parser.add_argument("--joins", type=int, default=200)
    parser.add_argument("--join-sources", type=int, default=20, help="client addresses the joins come from")
    parser.add_argument("--storm-threads", type=int, default=16)
    parser.add_argument(
        "--no-pin", action="store_true", help="run the attacker and the storm on the service's CPUs too"
    )
    parser.add_argument(
        "--firewall",
        action="store_true",
        help="limit new connections per address in the kernel (agora deploy firewall's rules; root, nftables)",
    )
    args = parser.parse_args()
    if args.firewall:
        enter_own_network_namespace()  # before any process or socket: they all live in it
    service_cpus, other_cpus = cpu_split(args.no_pin)
    pin(service_cpus)  # the honest client shares the service's CPU
    state = Path(tempfile.mkdtemp(prefix="agora-bench-services-"))
    tokens = [write_demo_token_file(state / "tokens.json", f"user{index}") for index in range(args.joins)]
    conn, child = CONTEXT.Pipe()
    server = CONTEXT.Process(target=serve, args=(state, child, service_cpus), daemon=True)
    server.start()
    url = conn.recv()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    port = int(port)
    baseline: dict = {"times": [], "failures": 0}
    phases: dict[str, dict] = {}
    attackers: dict[str, dict] = {}
    try:
        with kernel_limit(port, args.firewall):
            for count in (int(text) for text in args.slow.split(",") if text):
                add_baseline(baseline, measure(host, port, args.seconds, args.every_s))  # interleaved: the same load
                attacker = Attacker(host, port, count, args.trickle_s, other_cpus)
                try:
                    phases[f"slow_{count}"] = summary(measure(host, port, args.seconds, args.every_s), f"{count} slow")
                finally:
                    attackers[f"slow_{count}"] = {**attacker.holding, "opened_in_all": attacker.stop().get("opened")}
                print(f"{'':>12s}  attacker: {attackers[f'slow_{count}']}", flush=True)
            add_baseline(baseline, measure(host, port, args.seconds, args.every_s))
            phases["storm"], joins = run_storm(url, host, port, tokens, args, other_cpus)
    finally:
        conn.send("stop")
        server.join(15)
    phases = {"baseline": summary(baseline, "baseline"), **phases}
    print(
        json.dumps({**figures(phases, attackers, joins), "pinned": service_cpus is not None, "firewall": args.firewall})
    )
    return 0


def enter_own_network_namespace() -> None:
    """Move this process into a new network namespace with ``lo`` up; it goes away with the bench's last process."""
    if os.geteuid() != 0 or shutil.which("nft") is None or shutil.which("ip") is None:
        sys.exit("--firewall needs root, nft (apt-get install nftables) and ip (iproute2): run it again with sudo")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:  # os.unshare is Python 3.12+
        sys.exit(f"--firewall: unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)


@contextmanager
def kernel_limit(port: int, enabled: bool) -> Iterator[None]:
    """With ``enabled``: `agora deploy firewall`'s ruleset on ``port`` (default limits, no one exempt) for the block."""
    if not enabled:
        yield
        return
    apply_ruleset(render_ruleset([port]))
    print(
        f"{'firewall':>12s}: the kernel drops new connections to port {port} from an address beyond {DEFAULT_BURST} "
        f"at once and {DEFAULT_PER_MINUTE} a minute",
        flush=True,
    )
    try:
        yield
    finally:
        remove_ruleset()  # also on Ctrl-C


def cpu_split(no_pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """The CPUs of the service and the honest client, and those of the attacker and the storm.

    None, None: no pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if no_pin or len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def add_baseline(pooled: dict, measured: dict) -> None:
    pooled["times"] += measured["times"]
    pooled["failures"] += measured["failures"]


def figures(phases: dict[str, dict], attackers: dict[str, dict], joins: dict) -> dict:
    base = phases["baseline"].get("p99_ms")
    result: dict = {"bench": "services", "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    for phase, measured in phases.items():
        result.update({f"{phase}_{key}": value for key, value in measured.items()})
        if phase != "baseline" and base and measured.get("p99_ms") is not None:
            result[f"p99_ratio_{phase.removeprefix('slow_')}"] = round(measured["p99_ms"] / base, 2)
    for phase, held in attackers.items():
        result[f"{phase}_open_when_measured"] = held.get("open_at_report")
        result[f"{phase}_opened_in_all"] = held.get("opened_in_all")
    result["honest_failures"] = sum(measured["failures"] for measured in phases.values())
    return {**result, **joins}


if __name__ == "__main__":
    sys.exit(main())
