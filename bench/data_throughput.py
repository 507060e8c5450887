#!/usr/bin/env python3
"""Can the data pipeline keep a trainer fed?

Its tokens/s against the tokens/s one trainer consumes (tiny), side by side.

- pipeline: the TokenStream a trainer builds (agora_client/data/stream.py) over the run's data (tiny: the
  standard library's source) with the run's tokenizer (tiny: the shipped BPE tokenizer demo-bpe-2k.json),
  shard 0/1, the run's seed, drawn as the trainer draws it (``.batches(microbatch_size)``): read, skip the
  held-out documents, tokenize, shuffle buffer, pack. The first batch opens the source and fills the shuffle
  buffer (its time is reported as ``first_batch_s``); then --warmup seconds are drawn unmeasured. Also the
  same stream with the bytes tokenizer, for comparison. Tokens are counted as the trainer counts them
  (inputs: seq_len per sequence).
- trainer: the tiny model trained in this process as the swarm's workers train it (bench/_single_process.py:
  every stage chained, forward + backward + the stage epochs' optimizer steps), timed per microbatch, the
  batch drawn outside the timing. This is an upper bound on what one trainer of a local swarm consumes on
  this machine: a swarm does the same compute plus a recomputed forward per stage on backward, serialization
  and a network hop at every stage boundary. So ``headroom`` below is a lower bound.
- with --swarm, also a real local swarm (tiny, 1 worker per stage, 1 trainer; real processes on 127.0.0.1),
  started after the rounds: tokens/s from the trainer's [PROGRESS] lines after a warm-up (``headroom_swarm``).

The three (BPE pipeline, bytes pipeline, one-process trainer) alternate for --rounds rounds, each stream going
on where it stopped, so that load drift hits them alike; figures are medians over the rounds.
``headroom`` = pipeline tokens/s / trainer tokens/s, of the medians (target >= 20); ``headroom_lowest_round``
the lowest of the rounds' own ratios. ``pipeline_cpu_share`` is the CPU
(in cores) the pipeline needs to supply the trainer's rate (process CPU time: the tokenizer's threads count).

    python bench/data_throughput.py                 # ~1-2 min on 2 cores
    python bench/data_throughput.py --swarm         # + a local swarm, ~2 min more

Prints each round as it goes; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _single_process import InProcessPipeline, trainer_batches  # noqa: E402
from _trainer_progress import ProgressRecorder, tokens_per_second  # noqa: E402

from agora_client.config import RunConfig, load_config  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402

TARGET_HEADROOM = 20.0
BYTES_TOKENIZER = {"tokenizer": {"source": "bytes", "sha256": None, "eos_token": None}, "model": {"vocab_size": 256}}
SWARM_START_TIMEOUT_S = 300.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (BPE pipeline, bytes pipeline, trainer)")
    parser.add_argument(
        "--pipeline-seconds", type=float, default=4.0, help="measured seconds of each pipeline per round"
    )
    parser.add_argument("--trainer-seconds", type=float, default=10.0, help="measured seconds of the trainer per round")
    parser.add_argument(
        "--warmup", type=float, default=2.0, help="unmeasured seconds after each pipeline's first batch"
    )
    parser.add_argument("--swarm", action="store_true", help="also measure a real local swarm's trainer")
    parser.add_argument("--swarm-seconds", type=float, default=40.0, help="measured seconds of the swarm (--swarm)")
    parser.add_argument("--swarm-warmup", type=float, default=15.0, help="seconds of the swarm's trainer not measured")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="the swarm's logs go here (default: a temporary folder)"
    )
    args = parser.parse_args()
    if args.rounds < 1 or min(args.pipeline_seconds, args.trainer_seconds, args.swarm_seconds) <= 0:
        parser.error("--rounds and the measured seconds must be positive")
    return args


@dataclass
class Pipeline:
    """A trainer's batch stream, already opened and warmed up."""

    name: str
    batches: Iterator[torch.Tensor]
    first_batch_s: float

    @classmethod
    def opened(cls, name: str, config: RunConfig, warmup: float) -> "Pipeline":
        started = time.monotonic()
        batches = trainer_batches(config)
        next(batches)
        first_batch_s = time.monotonic() - started
        draw(batches, warmup)
        print(f"{name} pipeline: first batch after {first_batch_s:.1f} s", flush=True)
        return cls(name, batches, first_batch_s)


def draw(batches: Iterator[torch.Tensor], seconds: float) -> dict:
    """Batches drawn for ``seconds``: input tokens per wall second and per CPU second of this process."""
    tokens, started, cpu_started = 0, time.monotonic(), time.process_time()
    while time.monotonic() - started < seconds:
        tokens += next(batches)[:, :-1].numel()
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu_started
    return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / cpu if cpu > 0 else 0.0}


def train(model: InProcessPipeline, batches: Iterator[torch.Tensor], seconds: float) -> float:
    """Input tokens per second of training, timing only the training (forward, backward, steps)."""
    tokens, busy = 0, 0.0
    while busy < seconds:
        batch = next(batches)
        started = time.monotonic()
        model.train_microbatch(batch)
        busy += time.monotonic() - started
        tokens += batch[:, :-1].numel()
    return tokens / busy


def swarm_tokens_per_second(config: RunConfig, args: argparse.Namespace) -> float:
    """A local swarm's trainer: microbatches finished after the warm-up, from its [PROGRESS] lines."""
    recorder = ProgressRecorder()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-data-throughput-"))
    options = SwarmOptions(workers_per_stage=1, trainers=1, run_dir=run_dir, report_every=2.0)
    print(f"swarm: starting (1 worker per stage, 1 trainer); logs in {run_dir / 'logs'}", flush=True)
    with LocalSwarm(options, on_line=recorder) as swarm:
        trainer, deadline = swarm.trainers[0], time.monotonic() + SWARM_START_TIMEOUT_S
        while not any(point.microbatches for point in recorder.of(trainer.name)):
            if time.monotonic() > deadline or not trainer.alive:
                raise RuntimeError(f"the swarm's trainer finished no microbatch; see {trainer.log_path}")
            time.sleep(0.5)
        time.sleep(args.swarm_warmup)
        measured_from = time.monotonic()
        time.sleep(args.swarm_seconds)
        points = [point for point in recorder.of(trainer.name) if point.at >= measured_from]
    rate = tokens_per_second(points, config.optim.microbatch_size * config.model.seq_len)
    print(f"swarm trainer: {rate:,.0f} tokens/s", flush=True)
    return rate


def measure_rounds(config: RunConfig, args: argparse.Namespace) -> tuple[list[dict], dict[str, float]]:
    """Each round's figures, and each pipeline's time to its first batch."""
    bpe = Pipeline.opened(config.tokenizer.source, config, args.warmup)
    byte_level = Pipeline.opened("bytes", load_config(config.name, BYTES_TOKENIZER), args.warmup)
    model, batches = InProcessPipeline(config), trainer_batches(config)
    model.train_microbatch(next(batches))  # the first call pays one-off allocation costs
    rounds = []
    for index in range(args.rounds):
        pipeline, byte_pipeline = (
            draw(bpe.batches, args.pipeline_seconds),
            draw(byte_level.batches, args.pipeline_seconds),
        )
        trainer = train(model, batches, args.trainer_seconds)
        rounds.append(
            {
                "pipeline_tokens_per_s": pipeline["tokens_per_s"],
                "pipeline_tokens_per_cpu_s": pipeline["tokens_per_cpu_s"],
                "bytes_pipeline_tokens_per_s": byte_pipeline["tokens_per_s"],
                "trainer_tokens_per_s": trainer,
            }
        )
        print(
            f"round {index + 1}/{args.rounds}: pipeline {pipeline['tokens_per_s']:,.0f} tokens/s ({bpe.name}), "
            f"{byte_pipeline['tokens_per_s']:,.0f} (bytes); trainer {trainer:,.0f} tokens/s; "
            f"headroom {pipeline['tokens_per_s'] / trainer:,.0f}",
            flush=True,
        )
    return rounds, {pipeline.name: pipeline.first_batch_s for pipeline in (bpe, byte_level)}


def summary(config: RunConfig, rounds: list[dict], first_batch_s: dict[str, float]) -> dict:
    median = {key: statistics.median(measured[key] for measured in rounds) for key in rounds[0]}
    pipeline, trainer = median["pipeline_tokens_per_s"], median["trainer_tokens_per_s"]
    lowest = min(measured["pipeline_tokens_per_s"] / measured["trainer_tokens_per_s"] for measured in rounds)
    return {
        "bench": "data_throughput",
        "preset": config.name,
        "tokenizer": config.tokenizer.source,
        "microbatch_size": config.optim.microbatch_size,
        "seq_len": config.model.seq_len,
        "rounds": len(rounds),
        "pipeline_tokens_per_s": round(pipeline),
        "pipeline_tokens_per_cpu_s": round(median["pipeline_tokens_per_cpu_s"]),
        "pipeline_first_batch_s": round(first_batch_s[config.tokenizer.source], 2),
        "bytes_pipeline_tokens_per_s": round(median["bytes_pipeline_tokens_per_s"]),
        "bytes_pipeline_first_batch_s": round(first_batch_s["bytes"], 2),
        "trainer_tokens_per_s": round(trainer, 1),
        "trainer": "one process (an upper bound on a swarm trainer)",
        "headroom": round(pipeline / trainer, 1),
        "target_headroom": TARGET_HEADROOM,
        "meets_target": pipeline / trainer >= TARGET_HEADROOM,
        "headroom_lowest_round": round(lowest, 1),
        "pipeline_cpu_share": round(trainer / median["pipeline_tokens_per_cpu_s"], 4),
        "per_round": [{key: round(value, 1) for key, value in measured.items()} for measured in rounds],
    }


def main() -> int:
    args = parse_args()
    config = load_config("tiny")
    print(
        f"{config.name}: {config.optim.microbatch_size} x {config.model.seq_len} tokens per microbatch, "
        f"{args.rounds} rounds",
        flush=True,
    )
    result = summary(config, *measure_rounds(config, args))
    if args.swarm:
        swarm = swarm_tokens_per_second(config, args)
        result.update(
            swarm_trainer_tokens_per_s=round(swarm, 1),
            headroom_swarm=round(result["pipeline_tokens_per_s"] / swarm, 1) if swarm > 0 else None,
        )
    result.update(load_avg_1m=round(os.getloadavg()[0], 2), cpus=os.cpu_count(), torch_threads=torch.get_num_threads())
    print(
        f"pipeline {result['pipeline_tokens_per_s']:,} tokens/s against a trainer's {result['trainer_tokens_per_s']:,} "
        f"(one process): headroom {result['headroom']} (target >= {TARGET_HEADROOM:.0f})",
        flush=True,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
