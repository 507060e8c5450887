#!/usr/bin/env python3
"""How busy a swarm at the 8b model's proportions keeps its GPUs on home links (issue 47 parts 1-2).

The real processes run the real code (seeds and DHT, workers with tickets, the trainer's routing, Subspace
boundaries, stage epochs, SPARTA), every worker on a host of its own: a network namespace on a bridge
(tests/netns.py BridgedHosts; root and tc), its uplink shaped with ``tc ... tbf`` to an --uplink-mbit and its
downlink to 4x that (a tbf on the bridge's end of its veth); each rate runs on a fresh swarm started on links already
shaped, so that no qdisc changes under traffic and no rate inherits another's bans or backlog. The seeds and the
trainers share one more host whose link stays wide, as an operator's would. Only each stage's math is a stand-in
(bench/_utilization_standin.py, injected as tests/faulty_worker.py injects its faults): one request at a time,
taking the 8b stage's FLOPs per microbatch (model/memory.py, the plan's microbatch of 1 sequence) / (the card's dense
BF16 peak, bench/_gpu_stage_run.py x MFU) / s, where s is --scale. bench/gpu_check.py has not run on a GPU yet, so
MFU is 40% unless --mfu says otherwise.

One factor s scales every time and every byte count, so that the link time per unit of compute stays the 8b model's:
- boundaries: tiny's shapes with k = 128 coefficients per token (compression_rate 2) and a microbatch of as many
  128-token sequences as make tiny's bytes per microbatch the 8b boundary's (4,096 tokens x 212 B forward) / s; s
  is then recomputed from the whole number of sequences;
- SPARTA: the 8b preset's payload (int8, 5% of the stage per stage epoch) / s. A stage epoch is --epoch-microbatches
  instead of the 8b preset's 512 (so that a run sees rounds), and the slice shrinks by the same factor e = 512 /
  --epoch-microbatches, so that SPARTA's bytes per second of compute stay the 8b model's: every round averages the
  whole stand-in stage (fraction 1), padded with one flat parameter to 8b's slice / s / e values. A stage's full
  8b parameters are never allocated.
The tiny swarm has head, two bodies and tail: the 8b model's three other bodies are left out (a body is never the
bottleneck; a deeper pipeline only needs more microbatches in flight).

What does not scale: per-message costs (serialization, the daemons, Python) are paid per message, and with s < 1
there are fewer, larger messages than at 8b (optimistic) while on 2 shared cores each costs more (pessimistic);
there is no added round-trip time (tbf adds none, netem is not available): optimistic; the optimizer step and
SPARTA's apply are tiny's (the 8b AdamW step on the host takes seconds under the stage lock): optimistic;
matchmaking's fixed seconds come e times as often: pessimistic.

Stages are staffed by demand (agora_client/auth/stage_demand.py plan_demand, the tail's target --tail-workers, at
least 2 a stage for SPARTA). Trainers: one, with enough microbatches in flight to cover the pipeline's latency at
the ideal rate 3 times over (transfers and queues about double the compute's latency; --inflight to override;
--trainers splits them).

Per rate, measured over --seconds after --warmup: per worker, utilization (union of its busy intervals / wall, from
the stand-in's interval files), the share of wall its requests waited for the stage lock (epoch steps, SPARTA
results), its uplink's bytes over the link's capacity and tbf's overlimits (tc -s); per stage the median; SPARTA
rounds ok / begun and their median time; pipeline tokens/s (trainer [PROGRESS]) against the ideal, the slowest
stage's compute bound with the workers it has. What is left of a worker's wall is waiting for input: the bench
cannot split that between the links, the trainer's in-flight depth and retries.

    python3 bench/utilization.py --seconds 60 --uplink-mbit 100           # as root; ~5 min
    python3 bench/utilization.py --card 4090 --straggler                  # 100, 50 and 20 Mbit/s, then a straggler

Every namespace and qdisc goes on exit, on failure, Ctrl-C and SIGTERM too. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the namespace helpers live in tests/netns.py

from _gpu_stage_run import peak_bf16_flops  # noqa: E402
from _trainer_progress import ProgressRecorder, tokens_per_second  # noqa: E402
from _utilization_standin import FORWARD_SHARE, stage_seconds  # noqa: E402
from sparta_rounds import sparta_events, summarize  # noqa: E402

from agora_client.auth.stage_demand import plan_demand  # noqa: E402
from agora_client.config import load_config  # noqa: E402
from agora_client.model.memory import flops_per_microbatch  # noqa: E402
from agora_client.model.stages import param_counts  # noqa: E402
from agora_client.swarm.launcher import START_TIMEOUT, LocalSwarm, SwarmOptions  # noqa: E402
from agora_client.swarm.roles import WORKER_READY  # noqa: E402
from tests.netns import BridgedHosts, Host, unavailable  # noqa: E402

STANDIN = Path(__file__).resolve().parent / "_utilization_standin.py"
REFERENCE = "8b"
SEQ_LEN, COMPRESSION_RATE = 128, 2  # tiny's sequences; k = 256 / 2 = 128 floats per token cross a boundary
DEFAULT_MFU = 0.40  # the issue's, until bench/gpu_check.py has measured one
DOWNLINK_FACTOR = 4
INFLIGHT_MARGIN = 3.0  # 1.5 left the tail waiting for input 19-42% of the time: transfers and queues double the latency
REPORT_EVERY = 2.0
PROGRESS_TIMEOUT = 300.0
SENT = re.compile(r"Sent (\d+) bytes .*?overlimits (\d+)")


@dataclass(frozen=True)
class Plan:
    """The scaled swarm: what each stage's stand-in takes, holds and has."""

    scale: float  # s, from the whole number of sequences per microbatch
    microbatch: int  # sequences of SEQ_LEN tokens
    epoch_factor: float  # e: the 8b stage epoch over this run's
    seconds: dict[str, float]  # stage -> seconds per microbatch (forward + backward) on the card, / s
    pad_to: dict[str, int]  # stage -> values SPARTA averages each round
    workers: dict[str, int]  # stage -> workers (staffed by demand)
    inflight: int  # microbatches in flight over all trainers

    def capacity(self, stage: str, slower: float = 1.0) -> float:
        """Microbatches/s the stage's workers compute at most; with a straggler one of them is ``slower``."""
        speeds = [1.0] * self.workers[stage]
        speeds[0] /= slower
        return sum(speeds) / self.seconds[stage]

    def ideal(self, slower: float = 1.0) -> tuple[str, float]:
        """(the bottleneck stage, its microbatches/s)."""
        return min(((stage, self.capacity(stage, slower)) for stage in self.workers), key=lambda item: item[1])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--card", default="4090", help="the card every stage runs on (bench/_gpu_stage_run.py's table)")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="share of the card's dense BF16 peak reached")
    parser.add_argument("--scale", type=float, default=0.25, help="s: every time and byte count divided by it")
    parser.add_argument("--uplink-mbit", type=float, nargs="+", default=[100.0, 50.0, 20.0], help="home uplinks")
    parser.add_argument("--seconds", type=float, default=120.0, help="measured seconds per rate")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds after each rate change not measured")
    parser.add_argument("--straggler", action="store_true", help="then a swarm with one worker per stage 2x slower")
    parser.add_argument("--trainers", type=int, default=1, help="trainers sharing the microbatches in flight")
    parser.add_argument("--inflight", type=int, default=None, help="microbatches in flight, all trainers together")
    parser.add_argument("--tail-workers", type=int, default=3, help="the tail's workers; the others by demand")
    parser.add_argument("--epoch-microbatches", type=int, default=16, help="microbatches per stage epoch (8b: 512)")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args()
    if min(args.mfu, args.scale, args.seconds, args.warmup, *args.uplink_mbit) <= 0 or args.mfu > 1:
        parser.error("use positive durations, rates and scale, and an MFU in (0, 1]")
    if args.trainers < 1 or args.tail_workers < 2 or args.epoch_microbatches < 1:
        parser.error("use 1 or more trainers, 2 or more tail workers and 1 or more microbatches per epoch")
    return args


def card_peak(card: str) -> tuple[float, str]:
    for name in (card, f"RTX {card}"):
        peak, note = peak_bf16_flops(name)
        if peak is not None:
            return peak, note
    raise SystemExit(f"--card {card}: {note}")


def reference_stage(stage: str) -> str:
    """The 8b stage a tiny stage stands for: every body is alike."""
    return "body1" if stage.startswith("body") else stage


def plan(args: argparse.Namespace, stages: tuple[str, ...], peak: float) -> Plan:
    big = load_config(REFERENCE)
    per_token = 4 * (big.model.d_model // big.model.subspace.compression_rate) + 8  # forward: k floats + token id
    ours = 4 * (load_config("tiny").model.d_model // COMPRESSION_RATE) + 8
    boundary = big.model.seq_len * big.optim.microbatch_size * per_token
    microbatch = max(1, round(boundary / args.scale / (SEQ_LEN * ours)))
    scale = boundary / (microbatch * SEQ_LEN * ours)
    flops = {stage: flops_per_microbatch(big.model, reference_stage(stage), 1) for stage in stages}
    epoch_factor = big.optim.target_batch_size / big.optim.microbatch_size / args.epoch_microbatches
    counts = param_counts(big.model)
    slices = {stage: counts[reference_stage(stage)] * big.sparta.fraction for stage in stages}
    demand = plan_demand(flops, args.tail_workers).needs
    workers = {need.stage: max(2, round(need.target)) for need in demand}
    seconds = {stage: stage_seconds(flops[stage], peak, args.mfu, scale) for stage in stages}
    made = Plan(
        scale=scale,
        microbatch=microbatch,
        epoch_factor=epoch_factor,
        seconds=seconds,
        pad_to={stage: int(slices[stage] / scale / epoch_factor) for stage in stages},
        workers=workers,
        inflight=0,
    )
    latency = sum(seconds.values())  # one microbatch through every stage and back, links not counted
    inflight = args.inflight or math.ceil(INFLIGHT_MARGIN * made.ideal()[1] * latency)
    return Plan(**{**made.__dict__, "inflight": max(inflight, args.trainers)})


def run_config(made: Plan, args: argparse.Namespace, run_dir: Path) -> str:
    """tiny with the scaled boundary, microbatch, stage epoch and SPARTA; the path of its YAML."""
    config = load_config(
        "tiny",
        {
            "model": {"seq_len": SEQ_LEN, "subspace": {"compression_rate": COMPRESSION_RATE}},
            "optim": {
                "microbatch_size": made.microbatch,
                "target_batch_size": made.microbatch * args.epoch_microbatches,
                "inflight": max(1, made.inflight // args.trainers),
            },
            "sparta": {"period": 1, "fraction": 1.0, "payload": "int8"},
            "eval": {"every_s": load_config(REFERENCE).eval.every_s / made.scale},  # 8b's period, scaled
        },
    )
    path = run_dir / "utilization.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return str(path)


def standin_program(made: Plan, stage: str, slower: float, busy_dir: Path) -> list[str]:
    seconds = made.seconds[stage]
    return [
        sys.executable,
        str(STANDIN),
        "--forward-s",
        repr(seconds * FORWARD_SHARE),
        "--backward-s",
        repr(seconds * (1 - FORWARD_SHARE)),
        "--microbatch",
        str(made.microbatch),
        "--slower",
        str(slower),
        "--busy-dir",
        str(busy_dir),
        "--pad-to",
        str(made.pad_to[stage]),
    ]


def link_ends(hosts: BridgedHosts, number: int) -> tuple[Host, Host]:
    """(the host's end of its veth: its uplink, the bridge's end: its downlink)."""
    return hosts[number], Host(hosts.hub, "", hosts.ports[number])


def shape(links: list[tuple[Host, Host]], mbit: float) -> None:
    for up, down in links:
        up.shape_uplink(mbit)
        down.shape_uplink(mbit * DOWNLINK_FACTOR)


def sent(host: Host) -> tuple[int, int]:
    """(bytes, tbf overlimits) the host's uplink qdisc has counted."""
    match = SENT.search(host.run("tc", "-s", "qdisc", "show", "dev", host.device).stdout)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


class TrainerLines:
    """LocalSwarm's ``on_line``: the trainers' progress, and when each of their requests was retried."""

    def __init__(self) -> None:
        self.progress = ProgressRecorder()
        self.retries: list[float] = []  # wall-clock

    def __call__(self, name: str, line: str) -> None:
        self.progress(name, line)
        if "[RETRY]" in line:
            self.retries.append(time.time())

    def retried(self, since: float, until: float) -> int:
        return sum(1 for at in list(self.retries) if since <= at < until)


@dataclass
class Swarm:
    swarm: LocalSwarm
    lines: TrainerLines
    names: dict[str, tuple[str, int]]  # worker uid -> (stage, host number)
    busy_dir: Path
    slower: float  # of each stage's worker 0


def start_swarm(made: Plan, preset: str, hosts: BridgedHosts, run_dir: Path, slower: float, trainers: int) -> Swarm:
    lines, busy_dir = TrainerLines(), run_dir / "busy"
    slots = [(stage, index) for stage in made.workers for index in range(made.workers[stage])]
    numbers = {slot: 1 + number for number, slot in enumerate(slots)}
    options = SwarmOptions(
        preset=preset, trainers=trainers, run_dir=run_dir, report_every=REPORT_EVERY, host=hosts[0].address
    )
    swarm = LocalSwarm(options, on_line=lines, place_worker=lambda stage, index: hosts[numbers[(stage, index)]])
    try:
        with hosts[0].entered():
            swarm.start_seeds()
        launching = [
            swarm.start_worker(
                stage, wait=False, program=standin_program(made, stage, slower if index == 0 else 1.0, busy_dir)
            )
            for stage, index in slots
        ]
        for worker in launching:
            worker.wait_for(WORKER_READY, START_TIMEOUT)
        with hosts[0].entered():
            for _ in range(options.trainers):
                swarm.start_trainer()
    except BaseException:
        swarm.stop()
        raise
    names = {f"{stage}.0.{index}": (stage, number) for (stage, index), number in numbers.items()}
    return Swarm(swarm, lines, names, busy_dir, slower)


def wait_for_progress(running: Swarm) -> None:
    trainer = running.swarm.trainers[0]
    deadline = time.monotonic() + PROGRESS_TIMEOUT
    while not running.lines.progress.of(trainer.name):
        if time.monotonic() > deadline or not trainer.alive:
            raise RuntimeError(f"{trainer.name} made no progress; see {trainer.log_path}")
        time.sleep(0.5)


def busy_rows(path: Path) -> list[tuple[float, float, float]]:
    """(arrived, started, ended) of each request the stand-in logged."""
    if not path.exists():
        return []
    rows = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines() if line.count("\t") == 4]
    return [(float(row[1]), float(row[2]), float(row[3])) for row in rows]


def union_seconds(spans: list[tuple[float, float]], since: float, until: float) -> float:
    """Seconds of [since, until] covered by at least one span."""
    clipped = sorted((max(a, since), min(b, until)) for a, b in spans if b > since and a < until)
    total, reach = 0.0, since
    for start, end in clipped:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def worker_figures(running: Swarm, uid: str, since: float, until: float, link: dict) -> dict:
    rows = busy_rows(running.busy_dir / f"{uid}.tsv")
    wall = until - since
    return {
        "utilization": round(union_seconds([(s, e) for _, s, e in rows], since, until) / wall, 3),
        "lock_wait": round(union_seconds([(a, s) for a, s, _ in rows], since, until) / wall, 3),
        "uplink_busy": link["uplink_busy"],
        "overlimits": link["overlimits"],
    }


def measure(
    made: Plan, running: Swarm, links: dict[str, tuple[Host, Host]], mbit: float, args: argparse.Namespace
) -> dict:
    """Every figure at ``mbit`` up, over --seconds after --warmup."""
    time.sleep(args.warmup)
    before = {uid: sent(up) for uid, (up, _) in links.items()}
    since, from_monotonic = time.time(), time.monotonic()  # progress points are stamped monotonic, the rest wall-clock
    time.sleep(args.seconds)
    until, until_monotonic = time.time(), time.monotonic()
    after = {uid: sent(up) for uid, (up, _) in links.items()}
    time.sleep(2 + max(running.slower * seconds for seconds in made.seconds.values()))  # requests open at ``until`` log
    capacity = mbit * 1e6 / 8 * (until - since)
    link = {
        uid: {
            "uplink_busy": round((after[uid][0] - before[uid][0]) / capacity, 3),
            "overlimits": after[uid][1] - before[uid][1],
        }
        for uid in links
    }
    return {
        "workers": {uid: worker_figures(running, uid, since, until, link[uid]) for uid in links},
        "microbatches_per_s": round(pipeline_rate(running, from_monotonic, until_monotonic), 4),
        "sparta": summarize(sparta_events(running.swarm.options.run_dir), since, until),
        "retries": running.lines.retried(since, until),
        "measured_s": round(until - since, 1),
    }


def pipeline_rate(running: Swarm, start: float, end: float) -> float:
    """Microbatches/s the trainers finished between ``start`` and ``end`` (monotonic)."""
    return sum(
        tokens_per_second([p for p in running.lines.progress.of(trainer.name) if start <= p.at <= end], 1)
        for trainer in running.swarm.trainers
    )


def stage_table(made: Plan, running: Swarm, result: dict, mbit: float) -> dict:
    """Per stage: the workers' figures, their medians; the pipeline against the ideal."""
    stages = {}
    for stage in made.workers:
        mine = {uid: fig for uid, fig in result["workers"].items() if running.names[uid][0] == stage}
        fast = [fig["utilization"] for uid, fig in mine.items() if not (uid == f"{stage}.0.0" and running.slower > 1)]
        stages[stage] = {
            "workers": mine,
            "utilization_median": round(statistics.median(f["utilization"] for f in mine.values()), 3),
            "fast_utilization_median": round(statistics.median(fast), 3),
            "lock_wait_median": round(statistics.median(f["lock_wait"] for f in mine.values()), 3),
            "waiting_for_input_median": round(
                statistics.median(1 - f["utilization"] - f["lock_wait"] for f in mine.values()), 3
            ),
            "uplink_busy_median": round(statistics.median(f["uplink_busy"] for f in mine.values()), 3),
            "capacity_microbatches_per_s": round(made.capacity(stage, running.slower), 4),
        }
    bottleneck, ideal = made.ideal(running.slower)
    tokens = made.microbatch * SEQ_LEN
    # the bottleneck's work at the speed of each worker, as a share of its capacity; what of it finished no
    # microbatch went to requests retried elsewhere, microbatches given up, and spot checks' second requests
    work = sum(
        fig["utilization"] / (running.slower if uid == f"{bottleneck}.0.0" else 1.0) / made.seconds[bottleneck]
        for uid, fig in stages[bottleneck]["workers"].items()
    )
    return {
        "uplink_mbit": mbit,
        "downlink_mbit": mbit * DOWNLINK_FACTOR,
        "straggler_slower": running.slower,
        "bottleneck": bottleneck,
        "utilization": {stage: figures["utilization_median"] for stage, figures in stages.items()}
        | {"bottleneck": stages[bottleneck]["utilization_median"]},
        "tokens_per_s": round(result["microbatches_per_s"] * tokens, 1),
        "ideal_tokens_per_s": round(ideal * tokens, 1),
        "tokens_per_s_vs_ideal": round(result["microbatches_per_s"] / ideal, 3),
        "bottleneck_work_unfinished": round((work - result["microbatches_per_s"]) / ideal, 3),
        "sparta": result["sparta"],
        "retries": result["retries"],
        "measured_s": result["measured_s"],
        "stages": stages,
    }


def print_rate(row: dict) -> None:
    print(
        f"uplink {row['uplink_mbit']:g} Mbit/s (down {row['downlink_mbit']:g}), "
        f"straggler x{row['straggler_slower']:g}: "
        f"{row['tokens_per_s']:.0f} tokens/s = {row['tokens_per_s_vs_ideal']:.3f} of ideal "
        f"({row['ideal_tokens_per_s']:.0f}, bottleneck {row['bottleneck']}); SPARTA {row['sparta']['ok']}/"
        f"{row['sparta']['rounds']} ok, median {row['sparta']['median_duration_s']} s; {row['retries']} retries; "
        f"bottleneck work in no finished microbatch {row['bottleneck_work_unfinished']:.3f}",
        flush=True,
    )
    for stage, figures in row["stages"].items():
        each = " ".join(f"{fig['utilization']:.2f}" for fig in figures["workers"].values())
        print(
            f"  {stage:6s} utilization median {figures['utilization_median']:.3f} [{each}]; lock wait "
            f"{figures['lock_wait_median']:.3f}; waiting for input {figures['waiting_for_input_median']:.3f}; "
            f"uplink busy {figures['uplink_busy_median']:.3f}; capacity "
            f"{figures['capacity_microbatches_per_s']:.3f} microbatches/s",
            flush=True,
        )


def run_swarm(made: Plan, preset: str, hosts: BridgedHosts, run_dir: Path, mbit: float, slower: float, args) -> dict:
    """One swarm, started on links already shaped to ``mbit`` up (no qdisc changes under traffic), measured."""
    shape([link_ends(hosts, number) for number in range(1, len(hosts.hosts))], mbit)
    running = start_swarm(made, preset, hosts, run_dir, slower, args.trainers)
    try:
        wait_for_progress(running)
        print(f"swarm trains after {time.monotonic() - running.swarm.started_at:.0f}s; logs in {run_dir}", flush=True)
        links = {uid: link_ends(hosts, number) for uid, (_, number) in running.names.items()}
        row = stage_table(made, running, measure(made, running, links, mbit, args), mbit)
        print_rate(row)
        return row
    finally:
        running.swarm.stop()


def describe_plan(made: Plan, args: argparse.Namespace, peak_note: str) -> None:
    print(f"card: {peak_note}; MFU {args.mfu:g}; s = {made.scale:.4f} ({made.microbatch} sequences of {SEQ_LEN})")
    for stage in made.workers:
        print(
            f"  {stage:6s} {made.workers[stage]} workers, {made.seconds[stage]:.3f} s per microbatch "
            f"({made.seconds[stage] * made.scale:.3f} s at 8b), SPARTA slice {made.pad_to[stage]:,} int8 values "
            f"(8b's / s / e, e = {made.epoch_factor:g})",
            flush=True,
        )
    bottleneck, ideal = made.ideal()
    print(f"ideal: {bottleneck} bounds the pipeline at {ideal:.3f} microbatches/s; {made.inflight} in flight")


def main() -> int:
    args = parse_args()
    if reason := unavailable(shaping=True):
        raise SystemExit(f"workers on hosts of their own need network namespaces: {reason}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
    peak, peak_note = card_peak(args.card)
    stages = load_config("tiny").model.stage_names
    made = plan(args, stages, peak)
    describe_plan(made, args, peak_note)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-utilization-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    preset = run_config(made, args, run_dir)
    runs = [("even", 1.0, sorted(args.uplink_mbit, reverse=True))]
    if args.straggler:
        runs.append(("straggler", 2.0, [max(args.uplink_mbit)]))
    results = {}
    with BridgedHosts(f"agi47u-{os.getpid()}", 1 + sum(made.workers.values())) as hosts:
        for name, slower, rates in runs:
            results[name] = [
                run_swarm(made, preset, hosts, run_dir / f"{name}-{mbit:g}mbit", mbit, slower, args) for mbit in rates
            ]
    print(json.dumps(summary(made, args, peak_note, results)))
    return 0


def summary(made: Plan, args: argparse.Namespace, peak_note: str, results: dict[str, list[dict]]) -> dict:
    out = {
        "bench": "utilization",
        "card": peak_note,
        "mfu": args.mfu,
        "scale": round(made.scale, 4),
        "epoch_factor": made.epoch_factor,
        "workers": made.workers,
        "trainers": args.trainers,
        "inflight": made.inflight,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "rates": results["even"],
    }
    if "straggler" in results:
        even = {row["uplink_mbit"]: row for row in results["even"]}
        straggler = results["straggler"][0]
        out["straggler"] = straggler
        out["straggler_fast_drop"] = {
            stage: round(
                even[straggler["uplink_mbit"]]["stages"][stage]["utilization_median"]
                - figures["fast_utilization_median"],
                3,
            )
            for stage, figures in straggler["stages"].items()
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
