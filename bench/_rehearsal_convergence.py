"""The rehearsal's loss against one process trained on the same text to the same token count (bench/rehearsal.py;
what bench/convergence.py measures for the local swarm, here for the whole run with its churn).

Each trainer's log says, run by run (a [DATA] line starts one: `deploy up` starts a killed trainer again from its
shard's start), how many microbatches it finished and the mean loss of each stretch ([PROGRESS] lines), and the
held-out loss ([EVAL] lines). The single process (bench/_single_process.py) trains on the batches each run drew:
its shard's stream from the start, as many microbatches as the run finished, the trainers' runs merged in proportion
(the logs carry no clock to merge them by); then it evaluates the run's held-out sample.

- held-out: the trainers' last held-out losses (their mean) over the single process's after every microbatch. The
  swarm evaluated up to eval.every_s before the end, with fewer tokens trained: the ratio errs against the swarm.
- end: each trainer's loss over the last quarter of its last run's microbatches (of the last run that finished any;
  its progress lines there, weighted by their microbatches) over the single process's loss on the same batches,
  summed over the trainers. Microbatches the trainers dropped or finished out of order shift the match by a few
  batches, as in bench/convergence.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from _single_process import InProcessPipeline, trainer_batches
from _trainer_progress import EVAL, PROGRESS

from agora_client.config import RunConfig
from agora_client.data.heldout import held_out_sample
from agora_client.data.sources import Shard
from agora_client.data.tokenizer import load_run_tokenizer

TARGET_RATIO = 1.05
END_SHARE = 0.25  # the end: the last quarter of each trainer's last run
PRINT_EVERY_MICROBATCHES = 200
DATA = re.compile(r"\[DATA\] .* shard (\d+)/(\d+),")


@dataclass
class TrainerLog:
    """One trainer's runs: per run, its progress lines as (microbatches finished, mean loss since the line before)."""

    shard: Shard
    runs: list[list[tuple[int, float | None]]] = field(default_factory=list)
    last_eval: float | None = None

    @classmethod
    def read(cls, path: Path) -> "TrainerLog | None":
        log = None
        for line in path.read_text(errors="replace").splitlines():
            if found := DATA.search(line):
                log = log or cls(Shard(int(found[1]), int(found[2])))
                log.runs.append([])
            elif log and (found := PROGRESS.search(line)):
                log.runs[-1].append((int(found[1]), None if found[2] == "n/a" else float(found[2])))
            elif log and (found := EVAL.search(line)):
                log.last_eval = float(found[1])
        return log

    def finished(self) -> list[int]:
        """Microbatches each run finished."""
        return [lines[-1][0] if lines else 0 for lines in self.runs]

    def last_run(self) -> int | None:
        """The last run that finished a microbatch (a trainer started again as the run stopped finished none)."""
        return max((r for r, count in enumerate(self.finished()) if count), default=None)

    def end_window(self) -> list[tuple[int, int, float]]:
        """The last run's progress lines in its last quarter, as (first microbatch, end, mean loss)."""
        if (run := self.last_run()) is None:
            return []
        lines = self.runs[run]
        from_microbatch = lines[-1][0] * (1 - END_SHARE)
        windows, previous = [], 0
        for count, loss in lines:
            if previous >= from_microbatch and loss is not None and count > previous:
                windows.append((previous, count, loss))
            previous = count
        return windows


def replay(config: RunConfig, logs: list[TrainerLog]) -> tuple[InProcessPipeline, dict[tuple[int, int], list]]:
    """The single process trained on every run's batches, merged in proportion; each run's per-microbatch losses."""
    pipeline = InProcessPipeline(config)
    runs = [(t, r, count) for t, log in enumerate(logs) for r, count in enumerate(log.finished()) if count]
    streams = {(t, r): trainer_batches(config, logs[t].shard) for t, r, _ in runs}
    losses: dict[tuple[int, int], list] = {(t, r): [] for t, r, _ in runs}
    order = sorted(((done + 1) / count, t, r) for t, r, count in runs for done in range(count))
    for number, (_, t, r) in enumerate(order, start=1):
        losses[t, r].append(pipeline.train_microbatch(next(streams[t, r])))
        if number % PRINT_EVERY_MICROBATCHES == 0:
            print(f"  one process: {number}/{len(order)} microbatches", flush=True)
    return pipeline, losses


def convergence_card(config: RunConfig, log_dir: Path) -> dict:
    logs = [log for path in sorted(log_dir.glob("trainers-trainer*.log")) if (log := TrainerLog.read(path))]
    microbatches = sum(sum(log.finished()) for log in logs)
    print(f"the single process: {microbatches} microbatches, the trainers' batches", flush=True)
    pipeline, losses = replay(config, logs)
    single_held_out = pipeline.eval_loss(held_out_sample(config, load_run_tokenizer(config)))
    evals = [log.last_eval for log in logs if log.last_eval is not None]
    swarm_held_out = sum(evals) / len(evals) if evals else None
    swarm_end = single_end = 0.0
    end_microbatches = 0
    for t, log in enumerate(logs):
        single = losses.get((t, log.last_run()), [])
        for start, end, loss in log.end_window():
            swarm_end += loss * (end - start)
            single_end += sum(single[start:end])
            end_microbatches += end - start
    return {
        "microbatches": microbatches,
        "tokens": microbatches * config.optim.microbatch_size * config.model.seq_len,
        "trainer_runs": {f"shard {log.shard}": log.finished() for log in logs},
        "held_out": {
            "swarm": round(swarm_held_out, 4) if swarm_held_out else None,
            "single_process": round(single_held_out, 4),
            "ratio": round(swarm_held_out / single_held_out, 3) if swarm_held_out else None,
        },
        "end": {
            "microbatches": end_microbatches,
            "swarm": round(swarm_end / end_microbatches, 4) if end_microbatches else None,
            "single_process": round(single_end / end_microbatches, 4) if end_microbatches else None,
            "ratio": round(swarm_end / single_end, 3) if end_microbatches else None,
        },
        "target": TARGET_RATIO,
    }
