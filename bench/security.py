#!/usr/bin/env python3
"""What the untrusted-peer defences cost in pipeline throughput: checks on against off, side by side.

Ticket checks are a worker-side switch, so each round runs two local swarms (tiny preset, two workers per
stage, real processes on 127.0.0.1), one after the other, the order alternating per round so that machine
load falls on both alike:

- ``tickets``: workers check the ticket on every forward and backward (as deployed); one
  trainer per configuration, one after the other:
  - ``off``: no spot checks;
  - ``spot_<f>``: the trainer re-runs a share ``f`` of its stage requests on a second worker of the stage
    and compares the answers (agora_client.trainer.spotcheck), for every ``--fractions`` value;
- ``no_tickets``: workers serve any caller; one trainer without spot checks (``no_checks``).

For each configuration: pipeline tokens/s after a warm-up, and the spot checks the trainer made.
Last output line: one JSON object with the ratios to ``no_checks`` (every defence off).

``--calibration`` measures instead what the spot checks' calibration (agora_client.trainer.calibration)
makes of honest drift: one swarm of honest workers, three per stage, and one trainer checking a share
``--calibration-fraction`` of its requests for ``--seconds``. Per stage and kind of request: the checks,
strikes and bans, the state (calibrating / verifiable / unverifiable) and the calibrated tolerance
against random answers' distance (sqrt 2) less the margin, where a stage stops being verifiable.
Every worker is honest: any strike or ban is a false accusation. One run here (2 shared cores, 270 s at
0.3): 137-166 checks per stage, no strike, no ban, every stage and kind verifiable; tolerances forward /
backward: head 1.300 / 0.100, body1 0.714 / 1.292, body2 0.632 / 0.966, tail 0.127 / 0.807, against
random answers' 1.414 (unverifiable from 1.314).

    python bench/security.py                       # ~7 min on 2 cores
    python bench/security.py --rounds 2 --fractions 0.02 0.1 0.5
    python bench/security.py --calibration --seconds 300   # ~6 min on 2 cores
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

from agora_client.config import SpotCheckConfig  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402
from agora_client.trainer.calibration import RANDOM_DISTANCE  # noqa: E402

SPOT_STATS = re.compile(r"\[SPOTCHECK\] checks=(\d+)")
SPOT_TOTALS = re.compile(r"\[SPOTCHECK\] (checks=.*)$")
SPOT_STAGES = re.compile(r"\[SPOTCHECK\] stages (\{.*\})$")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-ticket-swarm", action="store_true", help="skip the swarm without ticket checks")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.2], help="spot-check fractions measured")
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per configuration per round")
    parser.add_argument("--warmup", type=float, default=12.0, help="seconds of each trainer not measured")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every configuration")
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight per trainer")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    parser.add_argument("--calibration", action="store_true",
                        help="measure the calibrated tolerances on an honest swarm (3 workers per stage) instead")
    parser.add_argument("--calibration-fraction", type=float, default=0.3, help="spot-check share of the --calibration run")
    return parser.parse_args()


NO_SPOT_CHECKS = ["--spot-check-fraction", "0"]


def configurations(fractions: list[float], no_ticket_swarm: bool) -> dict[bool, dict[str, list[str]]]:
    """Worker tickets on / off -> configuration name -> the trainer's extra arguments."""
    ticketed = {"off": NO_SPOT_CHECKS}
    ticketed.update({f"spot_{fraction:g}": ["--spot-check-fraction", str(fraction)] for fraction in fractions})
    return {True: ticketed, **({False: {"no_checks": NO_SPOT_CHECKS}} if no_ticket_swarm else {})}


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
    fractions = [*args.fractions, args.calibration_fraction]
    if min(args.seconds, args.warmup + 1, args.rounds, args.inflight) <= 0 or not all(0 < f <= 1 for f in fractions):
        print("--seconds, --rounds and --inflight must be positive, --fractions and --calibration-fraction in (0, 1]",
              file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-security-"))
    if args.calibration:
        print(json.dumps(measure_calibration(run_dir, args)))
        return 0
    configs = configurations(args.fractions, not args.no_ticket_swarm)
    results: dict[str, list[dict]] = {name: [] for by_name in configs.values() for name in by_name}
    for round_index in range(args.rounds):
        modes = list(configs) if round_index % 2 == 0 else list(configs)[::-1]
        for tickets in modes:
            names = list(configs[tickets]) if round_index % 2 == 0 else list(configs[tickets])[::-1]
            for name, result in measure_swarm(tickets, {name: configs[tickets][name] for name in names},
                                              run_dir / f"round{round_index + 1}-{'tickets' if tickets else 'no-tickets'}",
                                              args).items():
                results[name].append(result)
                print(f"round {round_index + 1} {name:10s}: {result['tokens_per_s']:7.1f} tokens/s, "
                      f"{result['spot_checks']} spot checks in {result['microbatches']} microbatches", flush=True)
    print(json.dumps(summarize(results, args)))
    return 0


def measure_swarm(tickets: bool, configs: dict[str, list[str]], run_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    """One swarm, its workers checking tickets or not, serving one trainer per configuration in turn."""
    recorder = ProgressRecorder()
    options = SwarmOptions(workers_per_stage=2, trainers=0, run_dir=run_dir, report_every=2.0, worker_tickets=tickets)
    swarm = LocalSwarm(options, on_line=recorder)
    try:
        swarm.start()
        print(f"swarm {'with' if tickets else 'without'} ticket checks up in {time.monotonic() - swarm.started_at:.0f}s "
              f"(2 workers per stage); logs in {run_dir / 'logs'}", flush=True)
        return {name: measure(swarm, recorder, trainer_args, args) for name, trainer_args in configs.items()}
    finally:
        swarm.stop()


def measure_calibration(run_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    """One honest swarm, three workers per stage, one trainer spot-checking for ``--seconds``: what calibration made of it."""
    options = SwarmOptions(workers_per_stage=3, trainers=0, run_dir=run_dir, report_every=5.0)
    swarm = LocalSwarm(options)
    try:
        swarm.start()
        print(f"swarm up in {time.monotonic() - swarm.started_at:.0f}s (3 honest workers per stage); logs in "
              f"{run_dir / 'logs'}", flush=True)
        trainer = swarm.start_trainer("--spot-check-fraction", str(args.calibration_fraction), "--shard", "0/1",
                                      "--inflight", str(args.inflight))
        time.sleep(args.seconds)
        lines = trainer.lines()
    finally:
        swarm.stop()
    stages = [json.loads(m.group(1)) for line in lines if (m := SPOT_STAGES.search(line))]
    totals = [m.group(1) for line in lines if (m := SPOT_TOTALS.search(line))]
    if not stages:
        raise RuntimeError(f"the trainer reported no spot checks in {args.seconds:g}s; see {trainer.log_path}")
    print(f"trainer: {totals[-1]}")
    for line in lines:  # state changes and bans, as the trainer said them
        if "[SPOTCHECK]" in line and not (SPOT_STAGES.search(line) or SPOT_TOTALS.search(line)):
            print(f"  {line.strip()}")
    return summarize_calibration(stages[-1], sum("[SPOTCHECK] banned" in line for line in lines), args)


def summarize_calibration(stages: dict[str, dict], banned: int, args: argparse.Namespace) -> dict[str, object]:
    margin = SpotCheckConfig().margin
    print(f"stage    checks strikes bans  kind      state         tolerance (unverifiable from {RANDOM_DISTANCE - margin:.3f})")
    summary: dict[str, object] = {"bench": "security_calibration", "preset": "tiny", "workers_per_stage": 3,
                                  "fraction": args.calibration_fraction, "seconds": args.seconds, "banned_lines": banned,
                                  "random_distance": round(RANDOM_DISTANCE, 4), "margin": margin}
    for stage, report in stages.items():
        summary.update({f"{stage}_checks": report["checks"], f"{stage}_strikes": report["strikes"], f"{stage}_bans": report["bans"]})
        for kind in ("forward", "backward"):
            standing = report[kind]
            tolerance = standing["tolerance"]
            shown = "-" if tolerance is None else f"{tolerance:.3f}"
            print(f"{stage:8s} {report['checks']:6d} {report['strikes']:7d} {report['bans']:4d}  {kind:9s} "
                  f"{standing['state']:13s} {shown} ({standing['samples']} honest distances)")
            summary[f"{stage}_{kind}_state"] = standing["state"]
            summary[f"{stage}_{kind}_tolerance"] = None if tolerance is None else round(tolerance, 4)
    return summary


def summarize(results: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, object]:
    summary: dict[str, object] = {"bench": "security", "preset": "tiny", "workers_per_stage": 2,
                                  "seconds_per_configuration": args.seconds * args.rounds, "inflight": args.inflight}
    for name, runs in results.items():
        summary[f"{name}_tokens_per_s"] = round(statistics.mean(run["tokens_per_s"] for run in runs), 1)
        summary[f"{name}_spot_checks"] = sum(run["spot_checks"] for run in runs)
    baseline = "no_checks" if "no_checks" in results else "off"
    base = max(summary[f"{baseline}_tokens_per_s"], 1e-9)  # type: ignore[arg-type]
    for name in results:
        if name != baseline:
            summary[f"throughput_ratio_{name}_over_{baseline}"] = round(summary[f"{name}_tokens_per_s"] / base, 3)  # type: ignore[operator]
    return summary


if __name__ == "__main__":
    sys.exit(main())
