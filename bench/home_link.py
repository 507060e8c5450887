#!/usr/bin/env python3
"""Pipeline tokens/s and SPARTA rounds of the tiny swarm on shaped home-like uplinks.

Subspace compression on against off.

Every worker of a local swarm (tiny preset, --workers per stage, one trainer) runs on a host of its own: a
network namespace on a bridge (tests/netns.py BridgedHosts; needs root and tc). The seeds and the trainer
share one more host whose link stays wide, as an operator's would. At each rate in turn every worker's uplink
is shaped with ``tc ... tbf``: first on a swarm with compression on (the preset), then on one with it off
(dense boundaries), which goes through the rates in reverse order so that drift in the machine's load falls
on both alike.

The rates put tiny's traffic where the 8b model's would be on home uplinks: the home rate times tiny's over
8b's boundary bytes per token (as `agora describe` gives them), scaled by the compressed figures (the traffic
Agora sends) for --home-mbit and by the dense ones for --dense-home-mbit (a rate where the dense boundary
binds), plus no shaping at all (what the CPUs allow). After each rate change the microbatches in flight
finish unmeasured; then each measurement lasts at least --seconds and six whole microbatches. At each rate:
tokens/s on and off and their ratio, whether the dense boundary is what limits throughput (off below 70% of
off unshaped), and the SPARTA rounds that succeeded among those begun, with their median duration.
Expected: the on/off ratio grows as the link narrows, towards tiny's byte ratio where the link binds.

    python bench/home_link.py                       # as root; ~12 min on 2 cores
    python bench/home_link.py --seconds 60 --home-mbit 100 20 5 --dense-home-mbit 50 20

Every namespace and qdisc goes on exit, on failure, Ctrl-C and SIGTERM too. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the namespace helpers live in tests/netns.py

from _trainer_progress import ProgressPoint, ProgressRecorder, tokens_per_second  # noqa: E402
from sparta_rounds import sparta_events, summarize  # noqa: E402

from agora_client.config import load_config  # noqa: E402
from agora_client.describe import describe_model  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402
from tests.netns import BridgedHosts, Host, unavailable  # noqa: E402

PRESET = "tiny"
REFERENCE = "8b"
DENSE_BINDS_BELOW = 0.7  # share of the unshaped dense tokens/s under which the link, not the CPU, limits dense
REPORT_EVERY = 2.0
PROGRESS_TIMEOUT = 300.0
MEASURED_MICROBATCHES = 6  # tokens/s counts whole microbatches: six keep the rounding of a narrow rate's count small


@dataclass(frozen=True)
class Rate:
    label: str
    mbit: float | None  # None: not shaped
    why: str


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--home-mbit",
        type=float,
        nargs="+",
        default=[200.0, 50.0, 20.0],
        help="home uplinks (Mbit/s) whose 8b compressed traffic is scaled onto tiny's",
    )
    parser.add_argument(
        "--dense-home-mbit",
        type=float,
        nargs="*",
        default=[20.0],
        help="home uplinks (Mbit/s) whose 8b dense traffic is scaled onto tiny's (the dense boundary binds)",
    )
    parser.add_argument("--workers", type=int, default=2, help="workers per stage (SPARTA needs 2 or more)")
    parser.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help=f"measured seconds per rate and mode (longer until {MEASURED_MICROBATCHES} microbatches finished)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        help="seconds after each rate change not measured (longer until the microbatches in flight finished)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=180.0, help="longest a warm-up or a measurement waits for its microbatches"
    )
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight in the trainer")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args()
    if (
        args.workers < 2
        or min(args.seconds, args.warmup + 1, args.max_seconds, args.inflight, *args.home_mbit, *args.dense_home_mbit)
        <= 0
    ):
        parser.error("use 2 or more workers per stage and positive durations and rates")
    return args


def bytes_per_token(preset: str) -> dict[str, int]:
    """Forward bytes per token of one boundary with its token id, dense and compressed.

    As `agora describe` counts them."""
    figures = describe_model(load_config(preset).model)["bytes_per_token"]
    return {
        "dense": figures["dense_activation"] + figures["token_id"],
        "compressed": figures["compressed_activation"] + figures["token_id"],
    }


def link_tokens_per_s(mbit: float, per_token: int, workers: int) -> float:
    """Tokens/s the shaped uplinks of a body stage can carry: each worker sends its output and its input's gradient."""
    return workers * mbit * 1e6 / 8 / (2 * per_token)


def plan_rates(args: argparse.Namespace, tiny: dict[str, int], big: dict[str, int]) -> list[Rate]:
    """No shaping, then the home links scaled by the compressed bytes and by the dense ones.

    The compressed bytes are the traffic Agora sends."""
    rates = [Rate("unshaped", None, "no limit: what the CPUs allow; the dense-binding check compares with it")]
    scaled = [("compressed", home) for home in args.home_mbit] + [("dense", home) for home in args.dense_home_mbit]
    for boundary, home in scaled:
        mbit = home * tiny[boundary] / big[boundary]
        carried = ", ".join(f"{kind} ~{link_tokens_per_s(mbit, tiny[kind], args.workers):,.0f}" for kind in tiny)
        rates.append(
            Rate(
                f"{home:g} Mbit {boundary}",
                mbit,
                f"{REFERENCE} {boundary} ({big[boundary]:,} B/token) on a {home:g} Mbit/s home uplink spends "
                f"as long per token on the link as {PRESET} {boundary} ({tiny[boundary]:,} B/token) at "
                f"{mbit:.2f} Mbit/s; bandwidth alone lets a body stage's uplinks carry at most tokens/s: "
                f"{carried}",
            )
        )
    return sorted(rates, key=lambda rate: -(rate.mbit or math.inf))  # widest first


def presets(run_dir: Path) -> dict[str, str]:
    """Compression mode -> run config: the preset as shipped, and the same with subspace compression disabled."""
    dense = load_config(PRESET, {"model": {"subspace": {"enabled": False}}})
    path = run_dir / f"{PRESET}-dense.yaml"
    path.write_text(yaml.safe_dump(dense.model_dump(mode="json")))
    return {"on": PRESET, "off": str(path)}


def worker_hosts(hosts: BridgedHosts, stages: tuple[str, ...], per_stage: int) -> dict[tuple[str, int], Host]:
    """(stage, index) -> the worker's own host; host 0 is the swarm's (seeds and trainer)."""
    slots = [(stage, index) for stage in stages for index in range(per_stage)]
    return {slot: hosts[1 + number] for number, slot in enumerate(slots)}


def shape(uplinks: list[Host], mbit: float | None) -> None:
    for host in uplinks:
        if mbit is None:
            host.unshape_uplink()
        else:
            host.shape_uplink(mbit)


def wait_for_progress(swarm: LocalSwarm, recorder: ProgressRecorder) -> None:
    trainer = swarm.trainers[0]
    deadline = time.monotonic() + PROGRESS_TIMEOUT
    while not recorder.of(trainer.name):
        if time.monotonic() > deadline or not trainer.alive:
            raise RuntimeError(f"{trainer.name} made no progress; see {trainer.log_path}")
        time.sleep(0.5)


def finished_since(points: list[ProgressPoint], since: float) -> int:
    """Microbatches finished between the first and the last progress point after ``since``."""
    after = [point for point in points if point.at >= since]
    return after[-1].microbatches - after[0].microbatches if after else 0


def wait_for_microbatches(
    swarm: LocalSwarm, recorder: ProgressRecorder, seconds: float, microbatches: int, args: argparse.Namespace
) -> None:
    """Wait at least ``seconds``, and until the trainer finished ``microbatches`` more (at most --max-seconds)."""
    trainer = swarm.trainers[0]
    since = time.monotonic()
    while time.monotonic() < since + args.max_seconds:
        if not trainer.alive:
            raise RuntimeError(f"{trainer.name} exited; see {trainer.log_path}")
        if time.monotonic() >= since + seconds and finished_since(recorder.of(trainer.name), since) >= microbatches:
            return
        time.sleep(0.5)


def measure(
    swarm: LocalSwarm, recorder: ProgressRecorder, uplinks: list[Host], rate: Rate, args: argparse.Namespace
) -> dict:
    """Tokens/s and SPARTA rounds at ``rate``, once the microbatches sent at the previous rate have finished."""
    shape(uplinks, rate.mbit)
    wait_for_microbatches(swarm, recorder, args.warmup, args.inflight, args)
    measured_from, wall_from = time.monotonic(), time.time()  # progress points are stamped monotonic, events wall-clock
    wait_for_microbatches(swarm, recorder, args.seconds, MEASURED_MICROBATCHES, args)
    points = [point for point in recorder.of(swarm.trainers[0].name) if point.at >= measured_from]
    tokens = swarm.config.optim.microbatch_size * swarm.config.model.seq_len
    return {
        "tokens_per_s": round(tokens_per_second(points, tokens), 1),
        "measured_s": round(time.monotonic() - measured_from, 1),
        "sparta": summarize(sparta_events(swarm.options.run_dir), wall_from, time.time()),
    }


def run_mode(
    mode: str,
    preset: str,
    swarm_host: Host,
    placements: dict[tuple[str, int], Host],
    rates: list[Rate],
    args: argparse.Namespace,
    run_dir: Path,
) -> dict[str, dict]:
    """One swarm with compression ``mode``, measured at every rate in order; rate label -> figures."""
    recorder = ProgressRecorder()
    options = SwarmOptions(
        preset=preset,
        workers_per_stage=args.workers,
        trainers=1,
        run_dir=run_dir / mode,
        report_every=REPORT_EVERY,
        trainer_args=("--inflight", str(args.inflight)),
        host=swarm_host.address,
    )
    swarm = LocalSwarm(options, on_line=recorder, place_worker=lambda stage, index: placements[(stage, index)])
    results = {}
    try:
        with swarm_host.entered():  # seeds and trainer; every worker goes to its own host
            swarm.start()
        wait_for_progress(swarm, recorder)
        print(
            f"compression {mode}: swarm trains after {time.monotonic() - swarm.started_at:.0f}s; "
            f"logs in {options.run_dir / 'logs'}",
            flush=True,
        )
        for rate in rates:
            result = results[rate.label] = measure(swarm, recorder, list(placements.values()), rate, args)
            sparta = result["sparta"]
            print(
                f"  {rate.label:22s} {result['tokens_per_s']:8.1f} tokens/s over {result['measured_s']:.0f}s; "
                f"SPARTA {sparta_cell(sparta)}",
                flush=True,
            )
    finally:
        swarm.stop()
        shape(list(placements.values()), None)  # the next swarm starts on wide links
    return results


def rows(rates: list[Rate], on: dict[str, dict], off: dict[str, dict]) -> list[dict]:
    dense_unshaped = off["unshaped"]["tokens_per_s"]
    table = []
    for rate in rates:
        on_tps, off_tps = on[rate.label]["tokens_per_s"], off[rate.label]["tokens_per_s"]
        table.append(
            {
                "rate": rate.label,
                "mbit": None if rate.mbit is None else round(rate.mbit, 3),
                "on_tokens_per_s": on_tps,
                "off_tokens_per_s": off_tps,
                "on_over_off": round(on_tps / off_tps, 2) if off_tps > 0 else None,
                "dense_binds": off_tps < DENSE_BINDS_BELOW * dense_unshaped,
                "measured_s": {"on": on[rate.label]["measured_s"], "off": off[rate.label]["measured_s"]},
                "sparta_on": on[rate.label]["sparta"],
                "sparta_off": off[rate.label]["sparta"],
            }
        )
    return table


def sparta_cell(sparta: dict) -> str:
    median = f"{sparta['median_duration_s']}s" if sparta["ok"] else "-"
    return f"{sparta['ok']}/{sparta['rounds']}, {median}"


def print_table(table: list[dict]) -> None:
    print(
        f"{'rate':22s}{'tiny Mbit':>10}{'on tok/s':>10}{'off tok/s':>11}{'on/off':>8}{'dense binds':>13}"
        f"   {'SPARTA on ok/n, median':24s}{'SPARTA off ok/n, median':24s}"
    )
    for row in table:
        mbit = "-" if row["mbit"] is None else f"{row['mbit']:.2f}"
        ratio = "-" if row["on_over_off"] is None else f"{row['on_over_off']:.2f}"
        print(
            f"{row['rate']:22s}{mbit:>10}{row['on_tokens_per_s']:>10.1f}{row['off_tokens_per_s']:>11.1f}{ratio:>8}"
            f"{'yes' if row['dense_binds'] else 'no':>13}   {sparta_cell(row['sparta_on']):24s}"
            f"{sparta_cell(row['sparta_off']):24s}"
        )


def main() -> int:
    args = parse_args()
    if reason := unavailable(shaping=True):
        raise SystemExit(f"workers on hosts of their own need network namespaces: {reason}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
    tiny, big = bytes_per_token(PRESET), bytes_per_token(REFERENCE)
    rates = plan_rates(args, tiny, big)
    print(f"bytes per token per boundary (forward, token id included): {PRESET} {tiny}, {REFERENCE} {big}")
    for rate in rates:
        print(f"rate {rate.label}{'' if rate.mbit is None else f' = {rate.mbit:.2f} Mbit/s'}: {rate.why}")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-home-link-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    stages = load_config(PRESET).model.stage_names
    results = {}
    with BridgedHosts(f"agi15b-{os.getpid()}", 1 + len(stages) * args.workers) as hosts:
        placements = worker_hosts(hosts, stages, args.workers)
        for number, (mode, preset) in enumerate(presets(run_dir).items()):
            order = rates if number == 0 else rates[::-1]
            results[mode] = run_mode(mode, preset, hosts[0], placements, order, args, run_dir)
    table = rows(rates, results["on"], results["off"])
    print_table(table)
    binding = [row["rate"] for row in table if row["dense_binds"]]
    if not binding:
        print("no rate limited the dense boundary: pass a narrower --dense-home-mbit", flush=True)
    print(
        json.dumps(
            {
                "bench": "home_link",
                "preset": PRESET,
                "reference": REFERENCE,
                "workers_per_stage": args.workers,
                "cpus": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "warmup_s": args.warmup,
                "min_seconds_per_rate": args.seconds,
                "bytes_per_token": {PRESET: tiny, REFERENCE: big},
                "tiny_byte_ratio": round(tiny["dense"] / tiny["compressed"], 2),
                "dense_binding_rates": binding,
                "rates": table,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
