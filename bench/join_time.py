"""Seconds from a contributor's start to its first processed batch on the local tiny swarm.

By default on two hosts: the swarm in one network namespace, the contributor in another, joined by
a veth pair (tests/netns.py; needs root, else pass --loopback). The contributor is given only the
auth URL. Split into start-up (run description), preflight, opening the worker's port, authorization
(with the dial-back), queue, snapshot download, worker start (and within it the wait for a calm
moment in the stage, see WorkerNode.start), sync phase 1 and sync phase 2, from the timestamps of
the runtime's own events. The download rate (the client's resumable, verifying download) is
compared, in the same run and from the contributor's host, with plain HTTP GETs of the same
snapshot files from the same server (latest.json and the manifest too, each file written to disk, as
`curl -o` would), and with those GETs followed by a sha256 of each file (`sha256sum`, the check the client
makes while the bytes arrive), alternated five times; medians.

Each host also gets CPU of its own: the swarm runs under a quota of ``--swarm-cpus`` cores and the
contributor under one of the remaining cores (cgroups: tests/cpu_quota.py). Without quotas the swarm's
training takes the contributor's CPU, and every CPU-bound phase of the join (imports, the DHT daemon,
building the worker) measures the swarm's load instead. Sync phases count the swarm's epochs, so they
depend on the swarm's speed either way.

``--link-mbit R`` limits what the swarm's host sends to R Mbit/s (``tc ... tbf``), the contributor's
downlink on a home line: the snapshot download then takes time, and the stage's build, which runs
beside the download, should leave the worker's start after it.

``--behind-router`` puts the contributor behind a home router instead (tests/netns_router.py: a real
miniupnpd and a masquerading nftables NAT): the client maps its port over UPnP before the dial-back, so
"open_port_s" holds the router search and mapping. Compare its figures with a run without it (the same
machine, one after the other): the phases after the dial-back do not depend on the path.

Usage: python bench/join_time.py [--loopback | --behind-router] [--swarm-cpus 1.0] [--link-mbit R]
(--swarm-cpus 0: no quotas)
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: agora_client, and tests/'s helpers
from _join_phases import first_batch, join_phases  # noqa: E402

from agora_client.events import NULL_WRITER, json_objects  # noqa: E402
from agora_client.snapshots import download_snapshot, latest_snapshot, read_manifest  # noqa: E402
from agora_client.snapshots.format import file_sha256  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402
from agora_client.swarm.processes import ManagedProcess  # noqa: E402
from tests import cpu_quota  # noqa: E402
from tests.netns import TwoHosts, unavailable  # noqa: E402
from tests.netns_router import HomeRouter  # noqa: E402
from tests.netns_router import unavailable as router_unavailable  # noqa: E402

FIRST_BATCH_TIMEOUT = 600.0


def runtime_events(runtime: ManagedProcess) -> list[dict]:
    return json_objects(runtime.lines())


def download_rates(swarm: LocalSwarm, stage: str, scratch: Path, repeats: int = 5) -> tuple[float, float, float]:
    """Median bytes/s of the client's download, of plain GETs of the same files and of those GETs followed by a
    sha256 of each file, alternated.

    The plain side does what `curl -o` would for the same snapshot: it GETs latest.json and the manifest, as the
    client must, and writes each file to disk. What remains between the two is the client's sha256 check and its
    marks: fixed costs that a small snapshot on a fast link shows most, and on a contributor with one core the
    hashing cannot overlap the receiving. The third side checks the files as a careful user would after `curl -o`
    (`sha256sum`: the file read back and hashed), the same work as the client's."""
    snapshot = latest_snapshot(swarm.snapshot_dir / stage)
    manifest = read_manifest(snapshot / "manifest.json")
    latest = f"{swarm.snapshot_server.url}/{stage}/latest.json"
    base = f"{swarm.snapshot_server.url}/{stage}/{snapshot.name}"
    size = sum(entry["size"] for entry in manifest["files"].values())
    ours, plain, checked = [], [], []
    with httpx.Client() as client:  # one client for all: none pays for a connection or a TLS context
        for attempt in range(repeats):
            started = time.perf_counter()
            download_snapshot(latest, scratch / str(attempt), events=NULL_WRITER, client=client)
            ours.append(size / (time.perf_counter() - started))
            for verify, rates in ((False, plain), (True, checked)):
                started = time.perf_counter()
                directory = scratch / f"plain-{attempt}-{verify}"
                _plain_download(client, latest, base, list(manifest["files"]), directory)
                if verify:
                    for name in manifest["files"]:
                        file_sha256(directory / name)
                rates.append(size / (time.perf_counter() - started))
    return statistics.median(ours), statistics.median(plain), statistics.median(checked)


def _plain_download(client: httpx.Client, latest: str, base: str, names: list[str], directory: Path) -> None:
    client.get(latest).raise_for_status()
    client.get(f"{base}/manifest.json").raise_for_status()
    directory.mkdir(parents=True)
    for name in names:
        with client.stream("GET", f"{base}/{name}") as response, open(directory / name, "wb") as out:
            response.raise_for_status()
            for block in response.iter_raw():
                out.write(block)


@contextmanager
def _inside(*places):
    """Processes started here run inside each place given: a host's network namespace, a CPU quota group."""
    with ExitStack() as stack:
        for place in places:
            if place is not None:
                stack.enter_context(place.entered())
        yield


class _BehindRouter(HomeRouter):
    """A home router seen as two hosts: ``a`` the swarm's (on the internet side), ``b`` the contributor's (at home)."""

    def __enter__(self) -> "_BehindRouter":
        super().__enter__()
        self.a, self.b = self.internet, self.home
        return self


def _two_hosts(behind_router: bool):
    return _BehindRouter(f"agi25b-{os.getpid()}") if behind_router else TwoHosts(f"agi11b-{os.getpid()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loopback", action="store_true", help="swarm and contributor both on 127.0.0.1")
    parser.add_argument(
        "--behind-router",
        action="store_true",
        help="the contributor behind a home router that maps its port over UPnP (needs miniupnpd)",
    )
    parser.add_argument(
        "--swarm-cpus",
        type=float,
        default=1.0,
        help="cores the swarm may use; the contributor gets the rest (default 1; 0: no quotas)",
    )
    parser.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="limit the swarm host's uplink, the contributor's downlink, to this many Mbit/s (two hosts only)",
    )
    args = parser.parse_args()
    missing = unavailable(shaping=args.link_mbit is not None)
    if not args.loopback and missing:
        raise SystemExit(f"two hosts need network namespaces: {missing}; or pass --loopback")
    if args.loopback and (args.link_mbit is not None or args.behind_router):
        raise SystemExit("--link-mbit and --behind-router need two hosts: they do not go with --loopback")
    if args.behind_router and router_unavailable():
        raise SystemExit(f"--behind-router: {router_unavailable()}")
    contributor_cpus = (os.cpu_count() or 1) - args.swarm_cpus
    if args.swarm_cpus and (cpu_quota.unavailable() or contributor_cpus <= 0):
        raise SystemExit(
            f"--swarm-cpus {args.swarm_cpus:g} needs CPU quotas and a core left for the contributor "
            f"({cpu_quota.unavailable() or f'{os.cpu_count()} cores here'}); or pass --swarm-cpus 0"
        )
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        hosts = None if args.loopback else stack.enter_context(_two_hosts(args.behind_router))
        quotas = stack.enter_context(cpu_quota.CpuQuotas(f"agora-join-{os.getpid()}")) if args.swarm_cpus else None
        swarm_cpu = quotas.group("swarm", args.swarm_cpus) if quotas else None
        client_cpu = quotas.group("contributor", contributor_cpus) if quotas else None
        on_swarm_host = partial(_inside, hosts and hosts.a, swarm_cpu)
        on_client_host = partial(_inside, hosts and hosts.b, client_cpu)
        options = SwarmOptions(
            workers_per_stage=1,
            run_dir=Path(tmp),
            publish_snapshots=True,
            report_every=5,
            host=hosts.a.address if hosts else "127.0.0.1",
        )
        swarm = LocalSwarm(options)
        stack.callback(swarm.stop)  # before the namespaces go (the stack unwinds last-in first-out)
        with on_swarm_host():  # every role, the snapshot server included, on the swarm's host
            swarm.start()
            auth_url, token = swarm.start_join_services(pacing=2.0)
        swarm.trainers[0].wait_for("[PROGRESS]", timeout=300)  # join a swarm that is mid-run
        if args.link_mbit is not None:
            hosts.a.shape_uplink(args.link_mbit)  # goes with the namespace
        started = time.time()
        with on_client_host():
            runtime = ManagedProcess(
                "runtime",
                [
                    "runtime",
                    "--cpu",
                    "--swarm",
                    auth_url,
                    "--config-dir",
                    str(Path(tmp) / "client"),
                    "--host-port",
                    "0",
                    *(["--insecure"] if args.behind_router else []),
                ],  # plain HTTP to the test's public-looking WAN
                Path(tmp) / "logs" / "runtime.log",
                env={"HF_TOKEN": token},
            )
        deadline = time.monotonic() + FIRST_BATCH_TIMEOUT
        while first_batch(runtime_events(runtime)) is None:
            if time.monotonic() > deadline or not runtime.alive:
                raise SystemExit(f"the joiner processed no batch; see {runtime.log_path}")
            time.sleep(0.5)
        events = runtime_events(runtime)
        stage = next(e for e in events if e["kind"] == "auth" and e["status"] == "authorized")["stage"]
        runtime.stop()
        for trainer in swarm.trainers:  # no more epochs: no new snapshot prunes the one measured below
            trainer.stop()
        with on_client_host():
            our_rate, get_rate, checked_rate = download_rates(swarm, stage, Path(tmp) / "rates")

    figures = {
        "topology": "loopback"
        if args.loopback
        else "behind a home router (UPnP)"
        if args.behind_router
        else "two network namespaces over a veth pair",
        "link_mbit": args.link_mbit,
        "swarm_cpus": args.swarm_cpus or None,
        "contributor_cpus": contributor_cpus if args.swarm_cpus else None,
        "stage": stage,
        **join_phases(events, started),
        "download_rate_bps": round(our_rate),
        "plain_get_rate_bps": round(get_rate),
        "download_rate_vs_plain_get": round(our_rate / get_rate, 3),
        "download_rate_vs_plain_get_and_sha256": round(our_rate / checked_rate, 3),
    }
    for key, value in figures.items():
        print(f"{key:32s} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
