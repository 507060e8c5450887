#!/usr/bin/env python3
"""Tokens per second of the local swarm against the same model trained in one process, side by side.

- swarm: `LocalSwarm` with the tiny preset, 2 seeds, 1 worker per stage and 1 trainer (shard 0/1), all
  real processes on 127.0.0.1; throughput from the trainer's progress lines after a warm-up.
- one process: the same stages (same construction and seed as the workers) chained in this process, fed
  the same batches (the trainer's data stream: shard 0/1, same seed, same microbatch size), with the same
  optimizer per stage (the workers' AdamW, the preset's settings) under the same autocast, the same stage
  epochs (a step every target_batch_size samples, gradients averaged over them, stage-wise clipping).
  It runs once before and once after the swarm so that machine load drift shows.
Also: the time from swarm start to the first optimizer step (the workers' first step events).
Wall-clock tokens/s depend on how much of a shared machine each side gets (a swarm of 7 processes wins CPU
time from other load that one process does not), so tokens per CPU-second are reported too: the single
process's own CPU time, and the summed CPU time of every swarm process (seeds, workers, trainer, their p2p
daemons) over the measured window.
Note the swarm recomputes each stage's forward on backward (activation recomputation), so it does 2 forwards
+ 1 backward per stage where the single process does 1 + 1. Last output line: one JSON object.

    python bench/pipeline_throughput.py                    # ~3 min on 2 cores
    python bench/pipeline_throughput.py --swarm-seconds 120 --local-seconds 40
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _single_process import InProcessPipeline, trainer_batches  # noqa: E402
from _trainer_progress import ProgressRecorder, tokens_per_second  # noqa: E402

from agora_client.config import RunConfig, load_config  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402

MIN_LOCAL_MICROBATCHES = 4  # a loaded machine can be that slow: fewer says little


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swarm-seconds", type=float, default=75.0, help="measured seconds of the swarm")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of the trainer not measured")
    parser.add_argument("--local-seconds", type=float, default=20.0, help="seconds of each single-process run")
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight in the trainer")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    return parser.parse_args()


def run_in_process(config: RunConfig, seconds: float) -> dict:
    model = InProcessPipeline(config)
    batches = trainer_batches(config)
    model.train_microbatch(next(batches))  # first call pays one-off allocation costs
    tokens, losses = 0, []
    start, cpu_start = time.monotonic(), time.process_time()
    while time.monotonic() - start < seconds or len(losses) < MIN_LOCAL_MICROBATCHES:
        batch = next(batches)
        losses.append(model.train_microbatch(batch))
        tokens += batch[:, :-1].numel()
    elapsed, cpu = time.monotonic() - start, time.process_time() - cpu_start
    return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / cpu, "microbatches": len(losses)}


def cpu_seconds(swarm: LocalSwarm) -> dict[int, float]:
    """User + system CPU seconds so far of every process of the swarm (whole process groups), by pid."""
    used = {}
    for process in swarm.processes:
        for pid in process.group_pids():
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            used[pid] = times.user + times.system
    return used


def first_steps(run_dir: Path, stages: list[str]) -> dict[str, float]:
    """Wall time of each stage's first step event (its first optimizer step)."""
    found = {}
    for stage in stages:
        path = run_dir / "events" / f"{stage}-0.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            event = json.loads(line)
            if event.get("kind") == "step":
                found[stage] = event["ts"]
                break
    return found


def run_swarm(config: RunConfig, args: argparse.Namespace, run_dir: Path) -> dict:
    recorder = ProgressRecorder()
    options = SwarmOptions(
        workers_per_stage=1,
        trainers=1,
        run_dir=run_dir,
        report_every=2.0,
        trainer_args=("--shard", "0/1", "--inflight", str(args.inflight)),
    )
    swarm = LocalSwarm(options, on_line=recorder)
    started_wall = time.time()
    try:
        swarm.start()
        workers_ready_s = time.time() - started_wall
        trainer = swarm.trainers[0]
        deadline = time.monotonic() + 240
        while not recorder.of(trainer.name):
            if time.monotonic() > deadline or not trainer.alive:
                raise RuntimeError(f"the trainer made no progress; see {trainer.log_path}")
            time.sleep(0.5)
        time.sleep(max(0.0, recorder.of(trainer.name)[0].at + args.warmup - time.monotonic()))
        measured_from, cpu_before = time.monotonic(), cpu_seconds(swarm)
        time.sleep(args.swarm_seconds)
        cpu_after = cpu_seconds(swarm)
        points = [point for point in recorder.of(trainer.name) if point.at >= measured_from]
        steps = first_steps(run_dir, list(config.model.stage_names))
    finally:
        swarm.stop()
    tokens = config.optim.microbatch_size * config.model.seq_len
    missing = [stage for stage in config.model.stage_names if stage not in steps]
    if missing:
        raise RuntimeError(f"no optimizer step seen for {', '.join(missing)}; see {run_dir / 'logs'}")
    microbatches = points[-1].microbatches - points[0].microbatches if points else 0
    cpu = sum(used - cpu_before.get(pid, 0.0) for pid, used in cpu_after.items())
    return {
        "tokens_per_s": tokens_per_second(points, tokens),
        "tokens_per_cpu_s": microbatches * tokens / cpu if cpu > 0 else 0.0,
        "microbatches": microbatches,
        "workers_ready_s": workers_ready_s,
        "first_step_s": min(steps.values()) - started_wall,
        "all_stages_stepped_s": max(steps.values()) - started_wall,
    }


def main() -> int:
    args = parse_args()
    if min(args.swarm_seconds, args.local_seconds, args.inflight) <= 0 or args.warmup < 0:
        print("--swarm-seconds, --local-seconds and --inflight must be positive", file=sys.stderr)
        return 2
    config = load_config("tiny")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-throughput-"))
    before = run_in_process(config, args.local_seconds)
    print(
        f"one process (before): {before['tokens_per_s']:.0f} tokens/s, {before['tokens_per_cpu_s']:.0f} per "
        f"CPU-second, over {before['microbatches']} microbatches",
        flush=True,
    )
    swarm = run_swarm(config, args, run_dir)
    print(
        f"swarm: {swarm['tokens_per_s']:.0f} tokens/s, {swarm['tokens_per_cpu_s']:.0f} per CPU-second, over "
        f"{swarm['microbatches']} microbatches; workers up after "
        f"{swarm['workers_ready_s']:.1f}s, first optimizer step {swarm['first_step_s']:.1f}s after start "
        f"(every stage by {swarm['all_stages_stepped_s']:.1f}s); logs in {run_dir / 'logs'}",
        flush=True,
    )
    after = run_in_process(config, args.local_seconds)
    print(
        f"one process (after): {after['tokens_per_s']:.0f} tokens/s, {after['tokens_per_cpu_s']:.0f} per CPU-second, "
        f"over {after['microbatches']} microbatches",
        flush=True,
    )
    local = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    local_cpu = (before["tokens_per_cpu_s"] + after["tokens_per_cpu_s"]) / 2
    load = psutil.getloadavg()[0]
    result = {
        "bench": "pipeline_throughput",
        "preset": config.name,
        "microbatch_size": config.optim.microbatch_size,
        "seq_len": config.model.seq_len,
        "swarm_tokens_per_s": round(swarm["tokens_per_s"], 1),
        "swarm_microbatches_measured": swarm["microbatches"],
        "single_process_tokens_per_s": round(local, 1),
        "single_process_before_tokens_per_s": round(before["tokens_per_s"], 1),
        "single_process_after_tokens_per_s": round(after["tokens_per_s"], 1),
        "ratio_swarm_over_single_process": round(swarm["tokens_per_s"] / local, 3),
        "swarm_tokens_per_cpu_s": round(swarm["tokens_per_cpu_s"], 1),
        "single_process_tokens_per_cpu_s": round(local_cpu, 1),
        "ratio_per_cpu_s_swarm_over_single_process": round(swarm["tokens_per_cpu_s"] / local_cpu, 3),
        "swarm_workers_ready_s": round(swarm["workers_ready_s"], 1),
        "swarm_first_optimizer_step_s": round(swarm["first_step_s"], 1),
        "swarm_all_stages_stepped_s": round(swarm["all_stages_stepped_s"], 1),
        "torch_threads": torch.get_num_threads(),
        "cpus": psutil.cpu_count(),
        "load_average_1min_at_end": round(load, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
