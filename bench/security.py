#!/usr/bin/env python3
"""What the untrusted-peer defences cost in pipeline throughput: checks on against off, side by side.

One local swarm (tiny preset, two workers per stage, real processes on 127.0.0.1) serves one trainer per
configuration, one after the other (the order alternates per round so that machine load falls on all
alike). Configurations:

- ``off``: no spot checks;
- ``spot_<f>``: the trainer re-runs a share ``f`` of its stage requests on a second worker of the stage
  and compares the answers (agora_client.trainer.spotcheck), for every ``--fractions`` value.

Ticket checks on every RPC (issue #12 item 1) are a worker-side switch: when they land, they become one
more entry of CONFIGURATIONS below (its trainer and worker arguments), measured the same way.
For each configuration: pipeline tokens/s after a warm-up, and the spot checks the trainer made.
Last output line: one JSON object with the ratios to ``off``.

    python bench/security.py                       # ~5 min on 2 cores
    python bench/security.py --rounds 2 --fractions 0.02 0.1 0.5
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _trainer_progress import ProgressRecorder, tokens_per_second  # noqa: E402

from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402

SPOT_STATS = re.compile(r"\[SPOTCHECK\] checks=(\d+)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.2], help="spot-check fractions measured")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per configuration per round")
    parser.add_argument("--warmup", type=float, default=12.0, help="seconds of each trainer not measured")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every configuration")
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight per trainer")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    return parser.parse_args()


def configurations(fractions: list[float]) -> dict[str, list[str]]:
    """Configuration name -> the trainer's extra arguments."""
    configs = {"off": ["--spot-check-fraction", "0"]}
    configs.update({f"spot_{fraction:g}": ["--spot-check-fraction", str(fraction)] for fraction in fractions})
    return configs


def measure(swarm: LocalSwarm, recorder: ProgressRecorder, trainer_args: list[str], args: argparse.Namespace) -> dict:
    trainer = swarm.start_trainer(*trainer_args, "--shard", "0/1", "--inflight", str(args.inflight))
    try:
        deadline = time.monotonic() + 180
        while not recorder.of(trainer.name):
            if time.monotonic() > deadline or not trainer.alive:
                raise RuntimeError(f"{trainer.name} made no progress; see {trainer.log_path}")
            time.sleep(0.5)
        start = recorder.of(trainer.name)[0]
        measured_from = start.at + args.warmup
        time.sleep(max(0.0, measured_from + args.seconds - time.monotonic()))
    finally:
        trainer.stop()
    points = [point for point in recorder.of(trainer.name) if point.at >= measured_from]
    tokens = swarm.config.optim.microbatch_size * swarm.config.model.seq_len
    checks = [int(m.group(1)) for line in trainer.lines() if (m := SPOT_STATS.search(line))]
    microbatches = points[-1].microbatches if points else 0
    return {"tokens_per_s": tokens_per_second(points, tokens), "spot_checks": checks[-1] if checks else 0,
            "microbatches": microbatches}


def main() -> int:
    args = parse_args()
    if min(args.seconds, args.warmup + 1, args.rounds, args.inflight) <= 0 or not all(0 < f <= 1 for f in args.fractions):
        print("--seconds, --rounds and --inflight must be positive, --fractions in (0, 1]", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-security-"))
    recorder = ProgressRecorder()
    swarm = LocalSwarm(SwarmOptions(workers_per_stage=2, trainers=0, run_dir=run_dir, report_every=2.0), on_line=recorder)
    configs = configurations(args.fractions)
    results: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        swarm.start()
        print(f"swarm up in {time.monotonic() - swarm.started_at:.0f}s (2 workers per stage); logs in {run_dir / 'logs'}",
              flush=True)
        for round_index in range(args.rounds):
            order = list(configs) if round_index % 2 == 0 else list(configs)[::-1]
            for name in order:
                result = measure(swarm, recorder, configs[name], args)
                results[name].append(result)
                print(f"round {round_index + 1} {name:10s}: {result['tokens_per_s']:7.1f} tokens/s, "
                      f"{result['spot_checks']} spot checks in {result['microbatches']} microbatches", flush=True)
    finally:
        swarm.stop()
    summary: dict[str, object] = {"bench": "security", "preset": swarm.config.name, "workers_per_stage": 2,
                                  "seconds_per_configuration": args.seconds * args.rounds, "inflight": args.inflight}
    for name, runs in results.items():
        summary[f"{name}_tokens_per_s"] = round(statistics.mean(run["tokens_per_s"] for run in runs), 1)
        summary[f"{name}_spot_checks"] = sum(run["spot_checks"] for run in runs)
    off = max(summary["off_tokens_per_s"], 1e-9)  # type: ignore[arg-type]
    for name in configs:
        if name != "off":
            summary[f"throughput_ratio_{name}_over_off"] = round(summary[f"{name}_tokens_per_s"] / off, 3)  # type: ignore[operator]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
