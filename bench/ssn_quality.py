#!/usr/bin/env python3
"""Loss of the tiny model with and without the Subspace Networks constraint, trained side by side.

Both models see the same batches (sequences of the standard library's source in the tiny run's BPE tokens, via
agora_client.data), in the same order, from the same seed, one step of each in turn so that
machine load falls on both alike. The unsplit model is used: the split pipeline is proven equal to it
in tests/test_model_split.py. Last output line: one JSON object with the figures.

    python bench/ssn_quality.py            # ~1-3 min on 2 cores
    python bench/ssn_quality.py --steps 600 --batch 16   # a longer, more telling run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_client.config import load_config  # noqa: E402
from agora_client.data.heldout import held_out_sample  # noqa: E402
from agora_client.data.sources import Shard  # noqa: E402
from agora_client.data.stream import TokenStream  # noqa: E402
from agora_client.data.tokenizer import load_run_tokenizer  # noqa: E402
from agora_client.model import FullModel, build_full_model, trainable_parameter_count  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per model")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the final loss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--report-every", type=int, default=10)
    return parser.parse_args()


def make_model(subspace: bool, seq_len: int, seed: int) -> tuple[FullModel, torch.optim.Optimizer]:
    run = load_config("tiny", {"model": {"seq_len": seq_len, "subspace": {"enabled": subspace}}})
    model = build_full_model(run.model, seed=seed)
    optim = run.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    return model, optimizer


def train_step(model: FullModel, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    loss = model(batch[:, :-1], batch[:, 1:]).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item(), time.perf_counter() - start


@torch.no_grad()
def evaluate(model: FullModel, batches: list[torch.Tensor]) -> float:
    return sum(model(batch[:, :-1], batch[:, 1:]).mean().item() for batch in batches) / len(batches)


def main() -> int:
    args = parse_args()
    if min(args.steps, args.batch, args.seq_len, args.eval_batches, args.threads) < 1:
        print("--steps, --batch, --seq-len, --eval-batches and --threads must be positive", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    # The tiny run's data and tokenizer; its held-out documents never enter the training stream.
    run = load_config(
        "tiny", {"model": {"seq_len": args.seq_len}, "eval": {"sequences": args.eval_batches * args.batch}}
    )
    tokenizer = load_run_tokenizer(run)
    train = TokenStream(run.data, run.eval, tokenizer, args.seq_len, Shard(0, 1), seed=args.seed).batches(args.batch)
    eval_batches = list(held_out_sample(run, tokenizer).split(args.batch))

    runs = {name: make_model(name == "subspace", args.seq_len, args.seed) for name in ("dense", "subspace")}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    seconds = {name: 0.0 for name in runs}
    initial = {name: evaluate(model, eval_batches) for name, (model, _) in runs.items()}
    print(f"held-out loss at init: dense {initial['dense']:.4f}  subspace {initial['subspace']:.4f}", flush=True)

    tokens_per_step = args.batch * args.seq_len
    for step in range(1, args.steps + 1):
        batch = next(train)
        for name, (model, optimizer) in runs.items():
            loss, elapsed = train_step(model, optimizer, batch)
            losses[name].append(loss)
            seconds[name] += elapsed
        if step % args.report_every == 0 or step == args.steps:
            dense, subspace = losses["dense"][-1], losses["subspace"][-1]
            print(
                f"step {step:5d}  tokens {step * tokens_per_step:8d}  loss dense {dense:.4f}  "
                f"subspace {subspace:.4f}  gap {subspace - dense:+.4f}",
                flush=True,
            )

    window = min(10, args.steps)
    train_loss = {name: sum(values[-window:]) / window for name, values in losses.items()}
    eval_loss = {name: evaluate(model, eval_batches) for name, (model, _) in runs.items()}
    gap = eval_loss["subspace"] - eval_loss["dense"]
    print(
        f"after {args.steps * tokens_per_step} tokens, held-out loss: dense {eval_loss['dense']:.4f}  "
        f"subspace {eval_loss['subspace']:.4f}  gap {gap:+.4f} nats ({gap / eval_loss['dense']:+.1%})"
    )
    result = {
        "bench": "ssn_quality",
        "preset": "tiny",
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens": args.steps * tokens_per_step,
        "params_dense": trainable_parameter_count(runs["dense"][0]),
        "params_subspace": trainable_parameter_count(runs["subspace"][0]),
        "eval_loss_init_dense": round(initial["dense"], 4),
        "eval_loss_init_subspace": round(initial["subspace"], 4),
        "train_loss_dense": round(train_loss["dense"], 4),
        "train_loss_subspace": round(train_loss["subspace"], 4),
        "eval_loss_dense": round(eval_loss["dense"], 4),
        "eval_loss_subspace": round(eval_loss["subspace"], 4),
        "gap_eval_nats": round(gap, 4),
        "gap_eval_relative": round(gap / eval_loss["dense"], 4),
        "train_seconds_dense": round(seconds["dense"], 2),
        "train_seconds_subspace": round(seconds["subspace"], 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
