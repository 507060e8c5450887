#!/usr/bin/env python3
"""Least-loaded routing against round-robin, with one slow and one fast worker in a stage.

One local swarm (tiny preset, real processes on 127.0.0.1): head, body2 and tail have two fast workers each
(``--others``), as in the demo; body1 has a fast worker and one made F times slower, run by
tests/faulty_worker.py with `--slower F` (every request takes F times its own compute time, the rest asleep, as
on a GPU F times slower that takes no CPU from the others). So body1 is the stage the slow worker can hold
back. body1 holds ``--body1-layers`` layers (3; tiny has 1): with one, a request's fixed cost (RPC,
serialization, the p2p daemon) outweighs its compute, so a GPU 3x slower makes the whole request far less than
3x slower; on a large model compute is most of it.
The same swarm then serves a trainer with `--routing least-loaded` and a trainer with `--routing round-robin`,
one after the other (alternating per round so that machine load falls on both alike). For each policy: the
share of body1's requests each worker served, and the trainer's pipeline throughput in tokens/s, both
measured after a warm-up. Last output line: one JSON object.

Each worker runs under a CPU quota of its own (``--cpus``, a cgroup per worker: tests/cpu_quota.py), as on
a host of its own. Without quotas the workers share the machine's cores, and the slow worker's sleep hands
its CPU to the others, so a CPU-bound machine hides what routing saves (``--cpus 0`` measures that case).
The default 8 in flight fill the stages, so throughput shows each policy's capacity; at 3 in flight the
pipeline is bound by latency, and a detour through the slow worker costs little. With ``--others 1`` every
other stage has one fast worker, as much capacity as body1 has under least-loaded routing, so body1 binds
neither way. The quotas must add up to less than the machine's cores (8 workers x 0.2 = 1.6 of 2 here, the
rest for the trainer, seeds and daemons): above that the machine, not the quotas, sets each worker's speed.

    python bench/routing.py                      # ~4 min on 2 cores
    python bench/routing.py --rounds 2 --seconds 60 --slower 4
    python bench/routing.py --cpus 0             # no quotas: workers share the cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from importlib import resources
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _trainer_progress import ProgressRecorder, served_by, tokens_per_second  # noqa: E402

from agora_client.swarm.launcher import START_TIMEOUT, WORKER_READY, LocalSwarm, SwarmOptions  # noqa: E402
from tests.cpu_quota import CpuQuotas, unavailable  # noqa: E402
from tests.faulty_worker import faulty  # noqa: E402

POLICIES = ("least-loaded", "round-robin")
SLOW_STAGE = "body1"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--slower", type=float, default=3.0, help="how many times slower the slow worker is (default 3)"
    )
    parser.add_argument("--seconds", type=float, default=45.0, help="measured seconds per policy per round")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of each trainer not measured")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (least-loaded, round-robin)")
    parser.add_argument("--inflight", type=int, default=8, help="microbatches in flight per trainer (default 8)")
    parser.add_argument("--others", type=int, default=2, help="fast workers in each stage but body1 (default 2)")
    parser.add_argument(
        "--body1-layers", type=int, default=3, help="transformer layers in body1 (default 3; tiny has 1)"
    )
    parser.add_argument(
        "--cpus",
        type=float,
        default=0.2,
        help="CPU cores each worker may use, a cgroup quota per worker (default 0.2; 0: no quotas)",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    return parser.parse_args()


def heavier_body1(run_dir: Path, layers: int) -> Path:
    """tiny with ``layers`` layers in body1: a preset file in run_dir."""
    preset = yaml.safe_load((resources.files("agora_client") / "presets" / "tiny.yaml").read_text())
    model = preset["model"]
    stage = next(stage for stage in model["stages"] if stage["name"] == SLOW_STAGE)
    model["n_layers"] += layers - stage["layers"]
    stage["layers"] = layers
    path = run_dir / f"tiny-{SLOW_STAGE}-{layers}-layers.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def measure(swarm: LocalSwarm, recorder: ProgressRecorder, policy: str, args: argparse.Namespace) -> dict:
    trainer = swarm.start_trainer("--routing", policy, "--shard", "0/1", "--inflight", str(args.inflight))
    try:
        deadline = time.monotonic() + 180
        while not recorder.of(trainer.name):
            if time.monotonic() > deadline or not trainer.alive:
                raise RuntimeError(f"{trainer.name} made no progress; see {trainer.log_path}")
            time.sleep(0.5)
        measured_from = recorder.of(trainer.name)[0].at + args.warmup
        time.sleep(max(0.0, measured_from + args.seconds - time.monotonic()))
    finally:
        trainer.stop()
    points = [point for point in recorder.of(trainer.name) if point.at >= measured_from]
    tokens = swarm.config.optim.microbatch_size * swarm.config.model.seq_len
    return {"tokens_per_s": tokens_per_second(points, tokens), "served": served_by(points, SLOW_STAGE)}


def measure_policies(
    args: argparse.Namespace, options: SwarmOptions, quotas: CpuQuotas | None, results: dict[str, list[dict]]
) -> tuple[str, str]:
    """Run the swarm (each worker in a quota group of its own, if ``quotas``) and measure each policy.

    Returns the (fast, slow) uid."""
    recorder = ProgressRecorder()
    place = None if quotas is None else (lambda stage, index: quotas.group(f"{stage}-{index}", args.cpus))
    swarm = LocalSwarm(options, on_line=recorder, place_worker=place)
    try:
        swarm.start()
        launching = [
            swarm.start_worker(stage, wait=False)
            for stage in swarm.workers
            if stage != SLOW_STAGE
            for _ in range(args.others - 1)
        ]
        slow = swarm.start_worker(SLOW_STAGE, program=faulty(slower=args.slower))
        for worker in launching:
            worker.wait_for(WORKER_READY, START_TIMEOUT)
        fast_uid, slow_uid = f"{SLOW_STAGE}.0.0", f"{SLOW_STAGE}.0.{slow.name.rsplit('-', 1)[1]}"
        workers = sum(len(stage_workers) for stage_workers in swarm.workers.values())
        print(
            f"swarm up in {time.monotonic() - swarm.started_at:.0f}s; {SLOW_STAGE}: fast {fast_uid}, slow {slow_uid} "
            f"({args.slower:g}x slower); {args.cpus:g} cores per worker, {workers * args.cpus:g} of {os.cpu_count()} "
            f"for {workers} workers; logs in {options.run_dir / 'logs'}",
            flush=True,
        )
        for round_index in range(args.rounds):
            for policy in POLICIES if round_index % 2 == 0 else POLICIES[::-1]:
                result = measure(swarm, recorder, policy, args)
                results[policy].append(result)
                served = result["served"]
                total = max(sum(served.values()), 1)
                print(
                    f"round {round_index + 1} {policy:12s}: {result['tokens_per_s']:7.1f} tokens/s; {SLOW_STAGE} "
                    f"requests fast {served.get(fast_uid, 0)} ({served.get(fast_uid, 0) / total:.0%}), "
                    f"slow {served.get(slow_uid, 0)} ({served.get(slow_uid, 0) / total:.0%})",
                    flush=True,
                )
    finally:
        swarm.stop()
    return fast_uid, slow_uid


def main() -> int:
    args = parse_args()
    if (
        args.slower <= 1
        or min(args.seconds, args.warmup + 1, args.rounds, args.inflight, args.others, args.body1_layers) <= 0
    ):
        print(
            "--slower must be above 1; --seconds, --rounds, --inflight, --others and --body1-layers positive",
            file=sys.stderr,
        )
        return 2
    if args.cpus > 0 and unavailable() is not None:
        print(
            f"--cpus {args.cpus:g} needs CPU quotas, and {unavailable()}; run as root, or pass --cpus 0",
            file=sys.stderr,
        )
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-routing-"))
    options = SwarmOptions(
        preset=str(heavier_body1(run_dir, args.body1_layers)),
        workers_per_stage=1,
        trainers=0,
        run_dir=run_dir,
        report_every=2.0,
    )
    results: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    with CpuQuotas(f"agora-routing-{os.getpid()}") if args.cpus > 0 else nullcontext() as quotas:
        fast_uid, slow_uid = measure_policies(args, options, quotas, results)
        # seconds the quotas held the workers back: above 0 shows they bound (read before the groups go)
        throttled_s = 0.0 if quotas is None else round(sum(group.throttled_s() for group in quotas.groups), 1)
    summary: dict[str, object] = {
        "bench": "routing",
        "preset": f"tiny, body1 with {args.body1_layers} layers",
        "slower": args.slower,
        "cpus_per_worker": args.cpus,
        "worker_throttled_s": throttled_s,
        "seconds_per_policy": args.seconds * args.rounds,
        "inflight": args.inflight,
        "other_stages_workers": args.others,
    }
    for policy, runs in results.items():
        key = policy.replace("-", "_")
        fast = sum(run["served"].get(fast_uid, 0) for run in runs)
        slow_count = sum(run["served"].get(slow_uid, 0) for run in runs)
        summary[f"{key}_tokens_per_s"] = round(statistics.mean(run["tokens_per_s"] for run in runs), 1)
        summary[f"{key}_fast_requests"] = fast
        summary[f"{key}_slow_requests"] = slow_count
        summary[f"{key}_slow_share"] = round(slow_count / max(fast + slow_count, 1), 3)
    summary["throughput_ratio_least_loaded_over_round_robin"] = round(
        summary["least_loaded_tokens_per_s"] / max(summary["round_robin_tokens_per_s"], 1e-9),
        3,  # type: ignore[operator]
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
