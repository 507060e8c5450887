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
random answers' 1.414 (unverifiable from 1.314). At 370 s (quiet, 2026-11-27) with the tolerance alone:
266-281 checks per stage, 3 strikes in body1 (no ban) as its backward drift outgrew the tolerance (0.881,
then 1.157, then 1.295), tail backward unverifiable at 1.354. Again with strikes only beyond
calibration.strike_distance: 238-269 checks per stage, no disagreement at all, so no strike and no ban;
body2 backward unverifiable at 1.413, every other stage and kind verifiable (head 1.112 / 0.100, body1
0.838 / 1.133, body2 0.571 forward, tail 0.124 / 0.698).

``--receipts-cost`` measures what the trainers' receipts (agora_client.trainer.receipts) cost a trainer: one swarm
(one worker per stage: the cost is the trainer's), two trainers side by side over the same seconds, one publishing
receipts (``--receipts on``, as deployed) and one not (``--receipts off``), neither spot-checking; each round swaps
their start order and data shards, so that neither keeps an advantage. Throughput is microbatches/s from each trainer's
progress lines; the last line's ``receipts_throughput_ratio`` is on / off (the mean of the rounds' ratios; target >=
0.98).

    python bench/security.py                       # ~7 min on 2 cores
    python bench/security.py --rounds 2 --fractions 0.02 0.1 0.5
    python bench/security.py --calibration --seconds 300   # ~6 min on 2 cores
    python bench/security.py --receipts-cost --rounds 4    # ~5 min on 2 cores
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

from _trainer_progress import ProgressRecorder, microbatches_per_second, tokens_per_second  # noqa: E402

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
    parser.add_argument(
        "--calibration",
        action="store_true",
        help="measure the calibrated tolerances on an honest swarm (3 workers per stage) instead",
    )
    parser.add_argument(
        "--calibration-fraction", type=float, default=0.3, help="spot-check share of the --calibration run"
    )
    parser.add_argument(
        "--receipts-cost",
        action="store_true",
        help="measure trainer throughput with receipts on against off (two trainers side by side) instead",
    )
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
    return {
        "tokens_per_s": tokens_per_second(points, tokens),
        "spot_checks": checks[-1] if checks else 0,
        "microbatches": microbatches,
    }


def main() -> int:
    args = parse_args()
    fractions = [*args.fractions, args.calibration_fraction]
    if min(args.seconds, args.warmup + 1, args.rounds, args.inflight) <= 0 or not all(0 < f <= 1 for f in fractions):
        print(
            "--seconds, --rounds and --inflight must be positive, --fractions and --calibration-fraction in (0, 1]",
            file=sys.stderr,
        )
        return 2
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-security-"))
    if args.calibration:
        print(json.dumps(measure_calibration(run_dir, args)))
        return 0
    if args.receipts_cost:
        print(json.dumps(measure_receipts_cost(run_dir, args)))
        return 0
    configs = configurations(args.fractions, not args.no_ticket_swarm)
    results: dict[str, list[dict]] = {name: [] for by_name in configs.values() for name in by_name}
    for round_index in range(args.rounds):
        modes = list(configs) if round_index % 2 == 0 else list(configs)[::-1]
        for tickets in modes:
            names = list(configs[tickets]) if round_index % 2 == 0 else list(configs[tickets])[::-1]
            for name, result in measure_swarm(
                tickets,
                {name: configs[tickets][name] for name in names},
                run_dir / f"round{round_index + 1}-{'tickets' if tickets else 'no-tickets'}",
                args,
            ).items():
                results[name].append(result)
                print(
                    f"round {round_index + 1} {name:10s}: {result['tokens_per_s']:7.1f} tokens/s, "
                    f"{result['spot_checks']} spot checks in {result['microbatches']} microbatches",
                    flush=True,
                )
    print(json.dumps(summarize(results, args)))
    return 0


def measure_swarm(
    tickets: bool, configs: dict[str, list[str]], run_dir: Path, args: argparse.Namespace
) -> dict[str, dict]:
    """One swarm, its workers checking tickets or not, serving one trainer per configuration in turn."""
    recorder = ProgressRecorder()
    options = SwarmOptions(workers_per_stage=2, trainers=0, run_dir=run_dir, report_every=2.0, worker_tickets=tickets)
    swarm = LocalSwarm(options, on_line=recorder)
    try:
        swarm.start()
        print(
            f"swarm {'with' if tickets else 'without'} ticket checks up in {time.monotonic() - swarm.started_at:.0f}s "
            f"(2 workers per stage); logs in {run_dir / 'logs'}",
            flush=True,
        )
        return {name: measure(swarm, recorder, trainer_args, args) for name, trainer_args in configs.items()}
    finally:
        swarm.stop()


def measure_calibration(run_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    """One honest swarm, three workers per stage, one trainer spot-checking for ``--seconds``.

    What calibration made of it."""
    options = SwarmOptions(workers_per_stage=3, trainers=0, run_dir=run_dir, report_every=5.0)
    swarm = LocalSwarm(options)
    try:
        swarm.start()
        print(
            f"swarm up in {time.monotonic() - swarm.started_at:.0f}s (3 honest workers per stage); logs in "
            f"{run_dir / 'logs'}",
            flush=True,
        )
        trainer = swarm.start_trainer(
            "--spot-check-fraction", str(args.calibration_fraction), "--shard", "0/1", "--inflight", str(args.inflight)
        )
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


def measure_receipts_cost(run_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    """One swarm, a trainer with receipts and one without side by side each round.

    Order and shards swapped per round."""
    recorder = ProgressRecorder()
    swarm = LocalSwarm(
        SwarmOptions(workers_per_stage=1, trainers=0, run_dir=run_dir, report_every=2.0), on_line=recorder
    )
    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        swarm.start()
        print(
            f"swarm up in {time.monotonic() - swarm.started_at:.0f}s (1 worker per stage); logs in {run_dir / 'logs'}",
            flush=True,
        )
        for round_index in range(args.rounds):
            modes = ["on", "off"] if round_index % 2 == 0 else ["off", "on"]
            measured = measure_side_by_side(swarm, recorder, modes, args)
            for mode in modes:
                rates[mode].append(measured[mode])
            print(
                f"round {round_index + 1}: receipts on {measured['on']:.3f}, off {measured['off']:.3f} microbatches/s "
                f"(ratio {measured['on'] / max(measured['off'], 1e-9):.3f})",
                flush=True,
            )
    finally:
        swarm.stop()
    ratios = [on / max(off, 1e-9) for on, off in zip(rates["on"], rates["off"], strict=True)]
    return {
        "bench": "security_receipts",
        "preset": "tiny",
        "workers_per_stage": 1,
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
        "inflight": args.inflight,
        "receipts_on_microbatches_per_s": round(statistics.mean(rates["on"]), 3),
        "receipts_off_microbatches_per_s": round(statistics.mean(rates["off"]), 3),
        "round_ratios": [round(ratio, 3) for ratio in ratios],
        "receipts_throughput_ratio": round(statistics.mean(ratios), 3),
        "target": 0.98,
    }


RECEIPTS_LINE = {"on": "[RECEIPTS] what each worker serves", "off": "[RECEIPTS] off"}


def measure_side_by_side(
    swarm: LocalSwarm, recorder: ProgressRecorder, modes: list[str], args: argparse.Namespace
) -> dict[str, float]:
    """Microbatches/s of one trainer per receipts mode, started in ``modes``' order, over the same measured seconds."""
    trainers = {
        mode: swarm.start_trainer(
            "--receipts", mode, *NO_SPOT_CHECKS, "--shard", f"{index}/{len(modes)}", "--inflight", str(args.inflight)
        )
        for index, mode in enumerate(modes)
    }
    try:
        deadline = time.monotonic() + 180
        while not all(recorder.of(trainer.name) for trainer in trainers.values()):
            if time.monotonic() > deadline or not all(trainer.alive for trainer in trainers.values()):
                raise RuntimeError(f"a trainer made no progress; see {[str(t.log_path) for t in trainers.values()]}")
            time.sleep(0.5)
        measured_from = max(recorder.of(trainer.name)[0].at for trainer in trainers.values()) + args.warmup
        measured_to = measured_from + args.seconds
        time.sleep(max(0.0, measured_to - time.monotonic()))
    finally:
        for trainer in trainers.values():
            trainer.stop()
    for mode, trainer in trainers.items():  # each trainer really ran as its mode says
        if not any(RECEIPTS_LINE[mode] in line for line in trainer.lines()):
            raise RuntimeError(f"{trainer.name} never said {RECEIPTS_LINE[mode]!r}; see {trainer.log_path}")
    return {
        mode: microbatches_per_second(
            [point for point in recorder.of(trainer.name) if measured_from <= point.at <= measured_to + 0.5]
        )
        for mode, trainer in trainers.items()
    }


def summarize_calibration(stages: dict[str, dict], banned: int, args: argparse.Namespace) -> dict[str, object]:
    margin = SpotCheckConfig().margin
    print(
        "stage    checks strikes bans  kind      state         tolerance (unverifiable from "
        f"{RANDOM_DISTANCE - margin:.3f})"
    )
    summary: dict[str, object] = {
        "bench": "security_calibration",
        "preset": "tiny",
        "workers_per_stage": 3,
        "fraction": args.calibration_fraction,
        "seconds": args.seconds,
        "banned_lines": banned,
        "random_distance": round(RANDOM_DISTANCE, 4),
        "margin": margin,
    }
    for stage, report in stages.items():
        summary.update(
            {
                f"{stage}_checks": report["checks"],
                f"{stage}_strikes": report["strikes"],
                f"{stage}_bans": report["bans"],
            }
        )
        for kind in ("forward", "backward"):
            standing = report[kind]
            tolerance = standing["tolerance"]
            shown = "-" if tolerance is None else f"{tolerance:.3f}"
            print(
                f"{stage:8s} {report['checks']:6d} {report['strikes']:7d} {report['bans']:4d}  {kind:9s} "
                f"{standing['state']:13s} {shown} ({standing['samples']} honest distances)"
            )
            summary[f"{stage}_{kind}_state"] = standing["state"]
            summary[f"{stage}_{kind}_tolerance"] = None if tolerance is None else round(tolerance, 4)
    return summary


def summarize(results: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, object]:
    summary: dict[str, object] = {
        "bench": "security",
        "preset": "tiny",
        "workers_per_stage": 2,
        "seconds_per_configuration": args.seconds * args.rounds,
        "inflight": args.inflight,
    }
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
