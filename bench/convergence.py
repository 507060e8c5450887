#!/usr/bin/env python3
"""Learning quality of the local swarm: its loss against the same model trained in one process, at equal token counts.

Three runs, one after the other, all on the preset's data and tokenizer (tiny: the standard library's source,
the shipped BPE tokenizer demo-bpe-2k.json); --runs quiet (or kill) makes only that swarm run:
- quiet: the local swarm (`LocalSwarm`, tiny preset, 2 workers per stage, SPARTA as the preset sets it, one
  trainer on shard 0/1; real processes on 127.0.0.1) trains for --seconds, counted from the trainer's first
  finished microbatch. Worker 0 of each stage publishes snapshots (in both swarm runs, so that they differ
  only by the kill).
- kill: a fresh swarm, the same in every respect; --kill-after seconds into its training, worker 1 of
  --kill-stage is SIGKILLed (a crash) and a fresh worker replaces it, joining as a contributor does: from a
  copy of the stage's latest published snapshot, through sync phases 1 and 2. Until the joiner is active
  the stage has one worker.
- one process: the same stages chained in this process (bench/_single_process.py), fed the trainer's very
  batches (the TokenStream the trainer builds: same data, tokenizer, shard, seed and microbatch size), with
  the workers' optimizer and the run config's settings (AdamW lr, betas, weight decay; the config has no lr
  schedule), the same autocast and the same stage epochs (a step every target_batch_size samples, gradients
  averaged, stage-wise clipping), for as many microbatches as the longest swarm run finished.

A swarm run trains for --seconds, or with --tokens until its trainer has finished that many tokens: then every
arm ends on the same text, which the ratio at the end depends on (the stream has stretches the models predict far
better, where a small lag is a large ratio). Matching is by token count, never by wall clock: every
--report-every seconds the trainer prints how many microbatches it has finished and their mean loss since its
previous line; the single process keeps the loss of each microbatch of the stream. Each swarm run is cut into
--segments equal ranges of its tokens, and in each range the swarm's mean loss is divided by the single
process's mean loss over exactly the same microbatches of the stream. The last range is the ratio "at the end".
Target: <= 1.05.

Held-out loss: every eval.every_s (tiny: 30 s; the first right at the start, before any training) the
trainer sends the run's held-out sample (`held_out_sample`) through the swarm, forward passes only, and
prints an [EVAL] line. Each is matched with the microbatches the trainer had finished at its preceding
[PROGRESS] line (at most --report-every seconds earlier; the evaluation ran between its start and that
line, while training went on beside it), and the single process evaluates its own model on the same sample,
forward only, after exactly that many microbatches. Reported: both losses and their ratio at each
evaluation, and the last one's ratio.

What the swarm cannot do identically, which is what the ratio measures:
- the two workers of a stage each step on the gradient of their own share of the stage's batch (no
  gradient all-reduce), so their weights drift apart; SPARTA averages a rotating slice (sparta.fraction)
  every sparta.period stage epochs;
- asynchrony: the trainer keeps microbatches in flight that straddle a stage's step, a backward
  recomputes the forward on weights that may have stepped since, stages step at different moments, and a
  stage epoch closes when the DHT shows target_batch_size samples, so it may hold a few more;
- spot checks (spot_checks.fraction) run some backward passes on a second worker too: those count twice;
- a microbatch the trainer drops (a request that failed) used up its batch of the stream without being
  counted, so the swarm's later microbatches sit one stream position later than the single process's
  they are compared with (the drops are reported); microbatches also finish out of order within the
  in-flight window;
- kill run: the gradients the killed worker had accumulated are lost, and its replacement starts from a
  snapshot up to publish_every epochs old.

Replica drift: every SPARTA round that averaged reports how far the worker's slice was from its group's
average before the update and right after it (relative L2, agora_client/averaging/drift.py); the workers'
events carry it. Reported per stage and segment (the rounds whose events fall in the segment's time): the mean
and largest drift before, the mean after; and each stage's rounds and the bytes each worker sent for them.
The trend: the least-squares slope of the ratio (each trainer progress line's swarm loss over the single
process's on the same microbatches) against tokens, over the lines ending in the second half of the run's
microbatches, per million tokens, with its standard error: a slope within about two standard errors of 0
is flat.

Arms: --sparta-fraction and --sparta-period replace the preset's (tiny: 25% every 2 stage epochs) in both
swarm runs; the JSON says the share of the stage each arm moves per stage epoch (fraction / period), so arms
can be compared at equal bytes (e.g. 12.5% every epoch against 25% every 2), and the bytes each worker sent.
--outer-momentum and --outer-lr give the swarm runs an outer Nesterov step on every averaged slice, in the manner
of DiLoCo (sparta.outer_momentum / outer_lr, agora_client/averaging/outer_momentum.py; DiLoCo's own 0.9 and 0.7);
--share-scaling scales each worker's step by its share of the stage epoch's samples, or that share's square root
(optim.share_scaling). All three are off in the preset; the JSON records them with the other SPARTA settings.
--inflight sets how many microbatches the trainer keeps in flight (optim.inflight; tiny: 2): fewer is less
staleness (the single process has none), at the risk of idle stages.

    python bench/convergence.py                    # ~8 min on a quiet 2-core machine
    python bench/convergence.py --seconds 300 --kill-after 100 --kill-stage tail
    python bench/convergence.py --long             # 20 min per run, 12 segments: ~50 min
    python bench/convergence.py --long --sparta-fraction 0.05 --sparta-period 4   # tiny's earlier default
    python bench/convergence.py --long --runs quiet --outer-momentum 0.9 --outer-lr 0.7

Prints progress, then a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _replica_drift import RoundSeen, drift_between, rounds_by_stage, sparta_tally  # noqa: E402
from _single_process import InProcessPipeline, trainer_batches  # noqa: E402
from _trainer_progress import EvalPoint, ProgressPoint, ProgressRecorder  # noqa: E402

from agora_client.config import RunConfig, load_config  # noqa: E402
from agora_client.data.heldout import held_out_sample  # noqa: E402
from agora_client.data.tokenizer import load_run_tokenizer  # noqa: E402
from agora_client.events import json_objects  # noqa: E402
from agora_client.snapshots import latest_snapshot  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402
from agora_client.swarm.processes import ManagedProcess  # noqa: E402
from tests.swarm_helpers import tiny_variant  # noqa: E402

TARGET_RATIO = 1.05
WORKERS_PER_STAGE = 2
PRINT_EVERY_S = 30.0
PRINT_EVERY_MICROBATCHES = 100
FIRST_MICROBATCH_TIMEOUT_S = 300.0
STALL_S = 300.0  # a swarm run that finishes no microbatch for this long has stalled
# --seconds, --kill-after and --segments when not given: the default bench, and --long (at least LONG_SECONDS a run)
SHORT_DEFAULTS = {"seconds": 150.0, "kill_after": 50.0, "segments": 6}
LONG_DEFAULTS = {"seconds": 1200.0, "kill_after": 400.0, "segments": 12}
LONG_SECONDS = LONG_DEFAULTS["seconds"]
RUNS = ("quiet", "kill")


@dataclass(frozen=True)
class LossWindow:
    """One trainer progress line: the mean loss of microbatches [start, end) of its stream."""

    start: int
    end: int
    loss: float
    began_at: float  # time.monotonic() of the previous progress line (-inf for the first)
    ended_at: float  # time.monotonic() of this one


@dataclass(frozen=True)
class Segment:
    """Both sides' mean loss over the same microbatches [start, end) of the stream."""

    start: int
    end: int
    swarm_loss: float
    single_loss: float
    began_at: float  # time.monotonic(): the stretch of the run its progress lines cover
    ended_at: float

    @property
    def ratio(self) -> float:
        return self.swarm_loss / self.single_loss


@dataclass(frozen=True)
class EvalComparison:
    """Both sides' held-out loss after the same number of microbatches."""

    microbatches: int
    swarm_loss: float
    single_loss: float

    @property
    def ratio(self) -> float:
        return self.swarm_loss / self.single_loss


@dataclass
class Replacement:
    victim: str
    joiner: str
    killed_at_wall: float
    killed_at_microbatch: int
    ready_at_microbatch: int
    ready_after_s: float
    active_after_s: float | None = None  # None: the joiner never finished its sync phases


@dataclass
class SwarmRun:
    name: str
    windows: list[LossWindow]
    evaluations: list[EvalPoint]  # the trainer's [EVAL] lines
    dropped: int  # microbatches the trainer gave up on
    load: float  # 1-minute load average at the end of the run
    replacement: Replacement | None
    rounds: dict[str, list[RoundSeen]]  # stage -> its workers' SPARTA events
    clock_offset: float  # time.time() - time.monotonic() in this process: events' wall times -> progress times


def parse_args(stages: tuple[str, ...], argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--long",
        action="store_true",
        help=f"the long bench: at least {LONG_SECONDS:.0f} training seconds per run; defaults {LONG_DEFAULTS}",
    )
    parser.add_argument(
        "--seconds", type=float, help=f"training seconds of each swarm run (default {SHORT_DEFAULTS['seconds']:.0f})"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="train each swarm run until its trainer has finished this many tokens instead of for "
        "--seconds, so that every arm ends on the same text",
    )
    parser.add_argument(
        "--kill-after",
        type=float,
        help=f"training seconds of the kill run before the worker dies (default {SHORT_DEFAULTS['kill_after']:.0f})",
    )
    parser.add_argument("--kill-stage", choices=stages, default="body1", help="stage whose worker 1 is killed")
    parser.add_argument(
        "--segments",
        type=int,
        help=f"equal token ranges the ratio is reported for (default {SHORT_DEFAULTS['segments']})",
    )
    parser.add_argument(
        "--sparta-fraction",
        type=float,
        default=None,
        help="share of a stage averaged per SPARTA round in the swarm runs (default: the preset's)",
    )
    parser.add_argument(
        "--sparta-period",
        type=int,
        default=None,
        help="stage epochs between SPARTA rounds in the swarm runs (default: the preset's)",
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="sparta.outer_momentum in the swarm runs: Nesterov momentum of an outer step on every "
        "averaged slice, at least 0 and below 1 (default: the preset's, 0)",
    )
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=None,
        help="sparta.outer_lr in the swarm runs: the outer step's size, above 0 (default: the preset's, 1)",
    )
    parser.add_argument(
        "--share-scaling",
        choices=("none", "linear", "sqrt"),
        default=None,
        help="optim.share_scaling in the swarm runs: scale each worker's step by its share of the stage "
        "epoch's samples, or that share's square root (default: the preset's, none)",
    )
    parser.add_argument(
        "--inflight",
        type=int,
        default=None,
        help="optim.inflight in the swarm runs: the trainer's microbatches in flight, its staleness "
        "(default: the preset's)",
    )
    parser.add_argument(
        "--runs",
        type=run_names,
        default=RUNS,
        help=f"the swarm runs to make, comma-separated, in this order (default {','.join(RUNS)})",
    )
    parser.add_argument("--report-every", type=float, default=2.0, help="seconds between the trainer's loss lines")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    parser.add_argument(
        "--payload",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="what the swarm's SPARTA rounds send (sparta.payload); the single process does not average",
    )
    args = parser.parse_args(argv)
    for name, default in (LONG_DEFAULTS if args.long else SHORT_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.tokens is not None and args.tokens <= 0:
        parser.error("--tokens counts tokens: more than 0")
    if args.long and args.seconds < LONG_SECONDS:
        parser.error(f"--long trains at least {LONG_SECONDS:.0f}s per run; leave --seconds out or raise it")
    if min(args.seconds, args.kill_after, args.segments, args.report_every) <= 0 or args.kill_after >= args.seconds:
        parser.error("durations and --segments must be positive, and --kill-after shorter than --seconds")
    if args.sparta_fraction is not None and not 0 < args.sparta_fraction <= 1:
        parser.error("--sparta-fraction is a share of the stage: more than 0, at most 1")
    if args.sparta_period is not None and args.sparta_period < 1:
        parser.error("--sparta-period counts stage epochs: at least 1")
    if args.outer_momentum is not None and not 0 <= args.outer_momentum < 1:
        parser.error("--outer-momentum is a momentum: at least 0, below 1")
    if args.inflight is not None and args.inflight < 1:
        parser.error("--inflight counts microbatches: at least 1")
    if args.outer_lr is not None and not args.outer_lr > 0:
        parser.error("--outer-lr is a step size: more than 0")
    return args


def run_names(text: str) -> tuple[str, ...]:
    """--runs: some of quiet and kill, comma-separated, each once."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or len(set(names)) != len(names) or not set(names) <= set(RUNS):
        raise argparse.ArgumentTypeError(f"give some of {', '.join(RUNS)}, comma-separated, each once; got {text!r}")
    return names


def loss_windows(points: list[ProgressPoint]) -> list[LossWindow]:
    """The microbatch range and mean loss of every progress line that saw a microbatch finish."""
    windows, done, previous_at = [], 0, -math.inf
    for point in points:
        if point.loss is not None and point.microbatches > done:
            windows.append(LossWindow(done, point.microbatches, point.loss, previous_at, point.at))
        done, previous_at = point.microbatches, point.at
    return windows


def microbatches_done(recorder: ProgressRecorder, trainer: ManagedProcess) -> int:
    points = recorder.of(trainer.name)
    return points[-1].microbatches if points else 0


def wait_for_first_microbatch(recorder: ProgressRecorder, trainer: ManagedProcess) -> float:
    """Block until the trainer has finished a microbatch; returns that moment (monotonic)."""
    deadline = time.monotonic() + FIRST_MICROBATCH_TIMEOUT_S
    while microbatches_done(recorder, trainer) == 0:
        if time.monotonic() > deadline or not trainer.alive:
            raise RuntimeError(f"the trainer finished no microbatch; see {trainer.log_path}")
        time.sleep(0.5)
    return time.monotonic()


def train_until(
    name: str,
    recorder: ProgressRecorder,
    trainer: ManagedProcess,
    started: float,
    until: float,
    microbatches: int | None = None,
) -> None:
    """Let the swarm train until ``until`` (monotonic), or with ``microbatches`` until the trainer has finished that
    many, saying how it goes; fail if the trainer exits or finishes nothing for STALL_S."""
    done, progressed_at = microbatches_done(recorder, trainer), time.monotonic()
    printed = progressed_at
    while done < microbatches if microbatches else time.monotonic() < until:
        time.sleep(0.5)
        if not trainer.alive:
            raise RuntimeError(f"the trainer exited; see {trainer.log_path}")
        previous, done, now = done, microbatches_done(recorder, trainer), time.monotonic()
        if done > previous:
            progressed_at = now
        elif now - progressed_at > STALL_S:
            raise RuntimeError(f"the trainer finished no microbatch in {STALL_S:.0f}s; see {trainer.log_path}")
        if now - printed >= PRINT_EVERY_S:
            printed = now
            points = [point for point in recorder.of(trainer.name) if point.loss is not None]
            loss = f"{points[-1].loss:.3f}" if points else "-"
            print(f"  {name}: {now - started:.0f}s, {done} microbatches, loss {loss}", flush=True)


def copy_latest_snapshot(swarm: LocalSwarm, stage: str) -> Path:
    """What a joiner downloads: the stage's latest published snapshot, copied (the publisher prunes old ones)."""
    published = latest_snapshot(swarm.snapshot_dir / stage)
    if published is None:
        raise RuntimeError(f"no {stage} snapshot published in {swarm.snapshot_dir}")
    return Path(shutil.copytree(published, swarm.options.run_dir / "joiner" / stage / published.name))


def crash_and_replace(swarm: LocalSwarm, stage: str, recorder: ProgressRecorder) -> Replacement:
    trainer = swarm.trainers[0]
    victim = swarm.workers[stage][1]  # not worker 0: it publishes the stage's snapshots
    killed_at_wall, killed_clock = time.time(), time.monotonic()
    killed_at_microbatch = microbatches_done(recorder, trainer)
    victim.kill_main()  # a crash: no goodbye to its averaging group or to the trainer
    victim.stop(grace=0.0)  # reaps what the crash left behind (p2pd)
    joiner = swarm.start_worker(stage, "--join", "--snapshot", str(copy_latest_snapshot(swarm, stage)))
    return Replacement(
        victim=victim.name,
        joiner=joiner.name,
        killed_at_wall=killed_at_wall,
        killed_at_microbatch=killed_at_microbatch,
        ready_at_microbatch=microbatches_done(recorder, trainer),
        ready_after_s=time.monotonic() - killed_clock,
    )


def seconds_to_active(run_dir: Path, worker: str, since_wall: float) -> float | None:
    """Seconds from ``since_wall`` to the worker's sync event "active" (the end of its sync phases)."""
    path = run_dir / "events" / f"{worker}.jsonl"
    events = json_objects(path.read_text(encoding="utf-8").splitlines()) if path.exists() else []
    active = [event["ts"] for event in events if event.get("kind") == "sync" and event.get("phase") == "active"]
    return active[0] - since_wall if active else None


def sparta_arm(args: argparse.Namespace) -> dict:
    """The SPARTA settings the swarm runs change in the preset: the payload, and the fraction, period and outer
    step if given."""
    arm = {
        "payload": args.payload,
        "fraction": args.sparta_fraction,
        "period": args.sparta_period,
        "outer_momentum": args.outer_momentum,
        "outer_lr": args.outer_lr,
    }
    return {name: value for name, value in arm.items() if value is not None}


def swarm_preset(run_dir: Path, args: argparse.Namespace) -> str:
    """tiny, with the arm asked for (SPARTA settings, the step's share scaling, the microbatches in flight), as a
    preset file the swarm's processes read."""
    run_dir.mkdir(parents=True, exist_ok=True)
    optim = {"share_scaling": args.share_scaling, "inflight": args.inflight}
    changes = {"sparta": sparta_arm(args), "optim": {name: value for name, value in optim.items() if value is not None}}
    return tiny_variant(run_dir / "tiny-arm.yaml", changes)


def train_swarm(
    name: str, args: argparse.Namespace, run_dir: Path, kill_stage: str | None, microbatches: int | None
) -> SwarmRun:
    """One swarm run: --seconds of training, or with ``microbatches`` until the trainer has finished that many."""
    recorder = ProgressRecorder()
    options = SwarmOptions(
        preset=swarm_preset(run_dir, args),
        workers_per_stage=WORKERS_PER_STAGE,
        trainers=1,
        run_dir=run_dir,
        report_every=args.report_every,
        publish_snapshots=True,
    )
    replacement = None
    with LocalSwarm(options, on_line=recorder) as swarm:
        trainer = swarm.trainers[0]
        print(
            f"{name}: swarm up in {time.monotonic() - swarm.started_at:.0f}s ({WORKERS_PER_STAGE} workers per stage); "
            f"logs in {run_dir / 'logs'}",
            flush=True,
        )
        started = wait_for_first_microbatch(recorder, trainer)
        if kill_stage is not None:
            train_until(name, recorder, trainer, started, started + args.kill_after)
            replacement = crash_and_replace(swarm, kill_stage, recorder)
            print(
                f"  {name}: killed {replacement.victim} after {replacement.killed_at_microbatch} microbatches; "
                f"{replacement.joiner} up {replacement.ready_after_s:.0f}s later",
                flush=True,
            )
        train_until(name, recorder, trainer, started, started + args.seconds, microbatches)
        windows = loss_windows(recorder.of(trainer.name))
        evaluations = recorder.evaluations_of(trainer.name)
        dropped = sum("microbatch dropped" in line for line in trainer.lines())
    if not windows:
        raise RuntimeError(f"the {name} swarm finished no microbatch; see {run_dir / 'logs'}")
    if replacement is not None:
        replacement.active_after_s = seconds_to_active(run_dir, replacement.joiner, replacement.killed_at_wall)
    rounds = rounds_by_stage(run_dir / "events")
    return SwarmRun(
        name, windows, evaluations, dropped, os.getloadavg()[0], replacement, rounds, time.time() - time.monotonic()
    )


@dataclass
class SingleProcessRun:
    losses: list[float]  # of each microbatch of the stream, in order
    steps: int  # optimizer steps taken
    eval_losses: dict[int, float]  # microbatches trained -> held-out loss then


def train_single_process(config: RunConfig, microbatches: int, evaluate_at: set[int]) -> SingleProcessRun:
    """The stream's first ``microbatches`` microbatches, trained one by one; the held-out loss after each count in
    ``evaluate_at`` (0: before training)."""
    model, batches, losses = InProcessPipeline(config), trainer_batches(config), []
    sample = held_out_sample(config, load_run_tokenizer(config))
    eval_losses = {0: model.eval_loss(sample)} if 0 in evaluate_at else {}
    for _ in range(microbatches):
        losses.append(model.train_microbatch(next(batches)))
        if len(losses) in evaluate_at:
            eval_losses[len(losses)] = model.eval_loss(sample)
        if len(losses) % PRINT_EVERY_MICROBATCHES == 0:
            print(f"  one process: {len(losses)}/{microbatches} microbatches, loss {losses[-1]:.3f}", flush=True)
    return SingleProcessRun(losses, model.steps, eval_losses)


def eval_comparisons(run: SwarmRun, single: SingleProcessRun) -> list[EvalComparison]:
    return [
        EvalComparison(point.microbatches, point.loss, single.eval_losses[point.microbatches])
        for point in run.evaluations
    ]


def segments(windows: list[LossWindow], single_losses: list[float], count: int) -> list[Segment]:
    """``count`` equal ranges of the run's microbatches; a progress line belongs to the range its end falls in."""
    total, found = windows[-1].end, []
    for index in range(count):
        low, high = total * index / count, total * (index + 1) / count
        members = [window for window in windows if low < window.end <= high]
        if not members:
            continue
        start, end = members[0].start, members[-1].end
        swarm_loss = sum(window.loss * (window.end - window.start) for window in members) / (end - start)
        found.append(
            Segment(
                start,
                end,
                swarm_loss,
                sum(single_losses[start:end]) / (end - start),
                members[0].began_at,
                members[-1].ended_at,
            )
        )
    return found


def ratio_slope(windows: list[LossWindow], single_losses: list[float], tokens_per_microbatch: int) -> dict:
    """Least-squares slope of the ratio against tokens (per million) over the progress lines ending in the second
    half of the run's microbatches, and its standard error; None where fewer than 3 lines."""
    half = windows[-1].end / 2
    points = [
        (
            (window.start + window.end) / 2 * tokens_per_microbatch / 1e6,
            window.loss / (sum(single_losses[window.start : window.end]) / (window.end - window.start)),
        )
        for window in windows
        if window.end > half
    ]
    if len(points) < 3:
        return {"per_million_tokens": None, "stderr": None, "lines": len(points)}
    mean_x, mean_y = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points) / (len(points) - 2)
    return {
        "per_million_tokens": round(slope, 5),
        "stderr": round(math.sqrt(residual / spread), 5),
        "lines": len(points),
    }


def drift_by_segment(run: SwarmRun, found: list[Segment], tokens_per_microbatch: int) -> dict[str, list[dict]]:
    """Each stage's replica drift in each segment: the SPARTA rounds whose events fall in the segment's stretch."""
    return {
        stage: [
            {
                "tokens_from": segment.start * tokens_per_microbatch,
                "tokens_to": segment.end * tokens_per_microbatch,
                **drift_between(rounds, segment.began_at + run.clock_offset, segment.ended_at + run.clock_offset),
            }
            for segment in found
        ]
        for stage, rounds in sorted(run.rounds.items())
    }


def events_in(segment: Segment, replacement: Replacement | None) -> str:
    if replacement is None:
        return ""
    marks = [
        (replacement.killed_at_microbatch, f"{replacement.victim} killed"),
        (replacement.ready_at_microbatch, f"{replacement.joiner} started"),
    ]
    return "; ".join(what for microbatch, what in marks if segment.start <= microbatch < segment.end)


def print_table(runs: list[tuple[SwarmRun, list[Segment]]], tokens_per_microbatch: int) -> None:
    print(f"\n{'run':<6} {'tokens':>17} {'swarm loss':>11} {'one-process loss':>17} {'ratio':>7}")
    for run, found in runs:
        for segment in found:
            tokens = f"{segment.start * tokens_per_microbatch // 1000}k-{segment.end * tokens_per_microbatch // 1000}k"
            print(
                f"{run.name:<6} {tokens:>17} {segment.swarm_loss:>11.4f} {segment.single_loss:>17.4f} "
                f"{segment.ratio:>7.3f}  {events_in(segment, run.replacement)}".rstrip()
            )
        print(
            f"{run.name:<6} ratio at the end {found[-1].ratio:.3f} (target <= {TARGET_RATIO}); "
            f"{run.dropped} microbatches dropped; load {run.load:.1f}"
        )


def print_eval_table(
    runs: list[SwarmRun], compared: dict[str, list[EvalComparison]], tokens_per_microbatch: int
) -> None:
    print(f"\n{'run':<6} {'held out at':>12} {'swarm loss':>11} {'one-process loss':>17} {'ratio':>7}")
    for run in runs:
        for comparison in compared[run.name]:
            tokens = f"{comparison.microbatches * tokens_per_microbatch // 1000}k"
            print(
                f"{run.name:<6} {tokens:>12} {comparison.swarm_loss:>11.4f} {comparison.single_loss:>17.4f} "
                f"{comparison.ratio:>7.3f}"
            )
        if not compared[run.name]:
            print(f"{run.name:<6} no [EVAL] line from the trainer")


def print_drift_table(
    runs: list[tuple[SwarmRun, list[Segment]]], single: SingleProcessRun, tokens_per_microbatch: int
) -> None:
    """Replica drift per stage and segment (mean before a round -> mean right after it), and the ratio's trend."""
    for run, found in runs:
        drift = drift_by_segment(run, found, tokens_per_microbatch)
        print(f"\n{run.name}: replica drift from the group's average (mean before -> after a SPARTA round)")
        print(f"{'tokens':>17} " + " ".join(f"{stage:>18}" for stage in drift))
        for index, segment in enumerate(found):
            tokens = f"{segment.start * tokens_per_microbatch // 1000}k-{segment.end * tokens_per_microbatch // 1000}k"
            cells = [drift[stage][index] for stage in drift]
            print(
                f"{tokens:>17} "
                + " ".join(
                    f"{cell['before_mean']:>8.4f} -> {cell['after_mean']:<6.4f}"
                    if cell["rounds"]
                    else f"{'no rounds':>18}"
                    for cell in cells
                )
            )
        slope = ratio_slope(run.windows, single.losses, tokens_per_microbatch)
        if slope["per_million_tokens"] is not None:
            print(
                f"{run.name}: ratio slope over the second half {slope['per_million_tokens']:+.4f} "
                f"+- {slope['stderr']:.4f} per million tokens ({slope['lines']} progress lines)"
            )


def eval_figures(compared: list[EvalComparison], tokens_per_microbatch: int) -> dict:
    return {
        "eval_ratio_at_end": round(compared[-1].ratio, 4) if compared else None,
        "eval_tokens_at_end": compared[-1].microbatches * tokens_per_microbatch if compared else None,
        "evals": [
            {
                "tokens": comparison.microbatches * tokens_per_microbatch,
                "swarm_eval_loss": round(comparison.swarm_loss, 4),
                "single_process_eval_loss": round(comparison.single_loss, 4),
                "ratio": round(comparison.ratio, 4),
            }
            for comparison in compared
        ],
    }


def run_figures(run: SwarmRun, found: list[Segment], single: SingleProcessRun, tokens_per_microbatch: int) -> dict:
    figures = {
        "tokens": run.windows[-1].end * tokens_per_microbatch,
        "ratio_at_end": round(found[-1].ratio, 4),
        "max_ratio": round(max(segment.ratio for segment in found), 4),
        "meets_target": found[-1].ratio <= TARGET_RATIO,
        "ratio_slope_second_half": ratio_slope(run.windows, single.losses, tokens_per_microbatch),
        "microbatches_dropped": run.dropped,
        "load_avg_1m": round(run.load, 2),
        "segments": [
            {
                "tokens_from": segment.start * tokens_per_microbatch,
                "tokens_to": segment.end * tokens_per_microbatch,
                "swarm_loss": round(segment.swarm_loss, 4),
                "single_process_loss": round(segment.single_loss, 4),
                "ratio": round(segment.ratio, 4),
            }
            for segment in found
        ],
        "drift": drift_by_segment(run, found, tokens_per_microbatch),
        "sparta_rounds": {stage: sparta_tally(rounds) for stage, rounds in sorted(run.rounds.items())},
    }
    if run.replacement is not None:
        replacement = run.replacement
        figures.update(
            {
                "killed": replacement.victim,
                "replacement": replacement.joiner,
                "killed_at_tokens": replacement.killed_at_microbatch * tokens_per_microbatch,
                "replacement_started_at_tokens": replacement.ready_at_microbatch * tokens_per_microbatch,
                "replacement_started_after_s": round(replacement.ready_after_s, 1),
                "replacement_active_after_s": None
                if replacement.active_after_s is None
                else round(replacement.active_after_s, 1),
            }
        )
    return figures


def sparta_figures(config: RunConfig, args: argparse.Namespace) -> dict:
    """The swarm runs' SPARTA arm, and the share of a stage it moves per stage epoch (equal shares: equal bytes)."""
    fraction = args.sparta_fraction if args.sparta_fraction is not None else config.sparta.fraction
    period = args.sparta_period if args.sparta_period is not None else config.sparta.period
    outer_momentum = args.outer_momentum if args.outer_momentum is not None else config.sparta.outer_momentum
    outer_lr = args.outer_lr if args.outer_lr is not None else config.sparta.outer_lr
    return {
        "fraction": fraction,
        "period": period,
        "share_per_epoch": round(fraction / period, 6),
        "outer_momentum": outer_momentum,
        "outer_lr": outer_lr,
    }


def share_scaling(config: RunConfig, args: argparse.Namespace) -> str:
    return args.share_scaling if args.share_scaling is not None else config.optim.share_scaling


def inflight(config: RunConfig, args: argparse.Namespace) -> int:
    return args.inflight if args.inflight is not None else config.optim.inflight


def main() -> int:
    config = load_config("tiny")
    args = parse_args(config.model.stage_names)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-convergence-"))
    tokens_per_microbatch = config.optim.microbatch_size * config.model.seq_len
    arm = sparta_figures(config, args)
    print(
        f"arm: payload {args.payload}, SPARTA {arm['fraction']:g} every {arm['period']} stage epochs, outer momentum "
        f"{arm['outer_momentum']:g}, outer lr {arm['outer_lr']:g}, share scaling {share_scaling(config, args)}, "
        f"{inflight(config, args)} microbatches in flight; "
        f"runs {', '.join(args.runs)}",
        flush=True,
    )
    kill_stages = {"quiet": None, "kill": args.kill_stage}
    goal = math.ceil(args.tokens / tokens_per_microbatch) if args.tokens else None
    runs = [train_swarm(name, args, run_dir / name, kill_stages[name], goal) for name in args.runs]
    evaluate_at = {point.microbatches for run in runs for point in run.evaluations}
    longest = max(run.windows[-1].end for run in runs)
    print(f"one process: the stream's first {longest} microbatches, evaluated after {sorted(evaluate_at)}", flush=True)
    single = train_single_process(config, max([longest, *evaluate_at]), evaluate_at)
    measured = [(run, segments(run.windows, single.losses, args.segments)) for run in runs]
    compared = {run.name: eval_comparisons(run, single) for run in runs}
    print_table(measured, tokens_per_microbatch)
    print_eval_table(runs, compared, tokens_per_microbatch)
    print_drift_table(measured, single, tokens_per_microbatch)
    result = {
        "bench": "convergence",
        "preset": config.name,
        "payload": args.payload,
        "long": args.long,
        "sparta": arm,
        "share_scaling": share_scaling(config, args),
        "inflight": inflight(config, args),
        "runs": list(args.runs),
        "workers_per_stage": WORKERS_PER_STAGE,
        "tokens_per_microbatch": tokens_per_microbatch,
        "seconds_per_run": None if args.tokens else args.seconds,
        "tokens_per_run": args.tokens,
        "tokenizer": config.tokenizer.source,
        "held_out_sequences": config.eval.sequences,
        "eval_every_s": config.eval.every_s,
        "target_ratio": TARGET_RATIO,
        **{
            run.name: run_figures(run, found, single, tokens_per_microbatch)
            | eval_figures(compared[run.name], tokens_per_microbatch)
            for run, found in measured
        },
        "single_process_microbatches": len(single.losses),
        "single_process_optimizer_steps": single.steps,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
