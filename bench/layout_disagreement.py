"""How far an offload-layout tail's answers stand from an fp32-layout tail's on the same weights and inputs, in the
spot checks' measure (agora_client/trainer/spotcheck.py, relative_distance), against their calibrated tolerances.

Two workers of the tail hold the same weights: one in the fp32 layout (fp32 weights, the run's autocast where the
device runs bf16 natively: model/layers.py runs_bf16), one in the offload layout (serving/device_copy.py: bf16
weights, bf16 autocast always). The fp32 layout runs once under bf16 autocast (what a GPU worker of a mixed
precision run such as 8b runs; on a CPU without native bf16 it falls back to fp32, cpu_bf16_native says which) and
once without. Both answer the same forward and backward requests through the worker's
StageBackend; the forward answer is the per-sequence losses, the backward answer the gradient of the boundary (what
a spot check compares). Compared with the tail's tolerances from the
calibration in bench/README.md ("Spot-check calibration": forward 0.12, backward 0.52 for tiny's tail) and with
the distance of an answer independent of the truth (sqrt 2).

Usage: python3 bench/layout_disagreement.py [--preset tiny] [--batches 4] [--microbatch N]
The last line is one JSON object: per pairing and kind the largest and median distance, and the margins.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading

import torch
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.config import RunConfig, load_config
from agora_client.model import build_stage
from agora_client.model.layers import native_bf16
from agora_client.serving.backend import StageBackend
from agora_client.serving.device_copy import DeviceCopy
from agora_client.trainer.spotcheck import relative_distance

CALIBRATED_TAIL = {"forward": 0.12, "backward": 0.52}  # bench/README.md, "Spot-check calibration" (tiny, 2026-11-27)
CPU = torch.device("cpu")


def tail_backend(run: RunConfig, layout: str, mixed_precision: bool) -> StageBackend:
    """A tail worker's backend in ``layout`` over the same weights (seed 0's, each scaled by 1 + 10 % noise), as
    agora_client/worker/node.py wires it."""
    master = build_stage(run.model, "tail", seed=0)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # away from the init, as training moves them: norm gains off 1.0, which bf16 rounds
        for parameter in master.parameters():
            if parameter.requires_grad:
                parameter.mul_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))
    copy = DeviceCopy(master, run.model, CPU, seed=0) if layout == "offload" else None
    example = master.example_inputs(2)
    return StageBackend(
        f"tail-{layout}",
        master if copy is None else copy.module,
        device_copy=copy,
        lock=threading.Lock(),
        on_samples=lambda samples: None,
        device=CPU,
        mixed_precision=mixed_precision,
        on_forward=lambda tokens, outputs: None,
        on_backward=lambda tokens: None,
        on_unhealthy=lambda reason: None,
        args_schema=tuple(BatchTensorDescriptor.from_tensor(t) for t in example),
        outputs_schema=BatchTensorDescriptor.from_tensor(torch.zeros(2)),
        min_batch_size=1,
        max_batch_size=64,
    )


def requests(run: RunConfig, count: int, microbatch: int) -> list[tuple[torch.Tensor, ...]]:
    """Boundaries at the scale a head sends (init_std), token ids, their next tokens as labels."""
    generator = torch.Generator().manual_seed(1)
    shape, width = (microbatch, run.model.seq_len), build_stage(run.model, "tail", seed=0, device="meta").boundary_width
    found = []
    for _ in range(count):
        tokens = torch.randint(0, run.model.vocab_size, shape, generator=generator)
        boundary = torch.randn(*shape, width, generator=generator) * run.model.init_std
        found.append((boundary, tokens, tokens.roll(-1, dims=1)))
    return found


def answers(backend: StageBackend, batch: tuple[torch.Tensor, ...]) -> dict[str, list[torch.Tensor]]:
    """A worker's forward answer and backward answer (the trainer's mean loss: 1/n per sequence)."""
    forward = list(backend.forward(*batch))
    grad = torch.full((batch[0].shape[0],), 1.0 / batch[0].shape[0])
    backward = list(backend.backward(*batch, grad))[:1]  # the boundary's gradient; token ids have none
    return {"forward": forward, "backward": backward}


def distances(first: StageBackend, second: StageBackend, batches) -> dict[str, dict[str, float]]:
    found: dict[str, list[float]] = {"forward": [], "backward": []}
    for batch in batches:
        a, b = answers(first, batch), answers(second, batch)
        for kind in found:
            found[kind].append(relative_distance(a[kind], b[kind]))
    return {
        kind: {
            "max": max(values),
            "median": statistics.median(values),
            "tolerance": CALIBRATED_TAIL[kind],
            "fraction_of_tolerance": max(values) / CALIBRATED_TAIL[kind],
            "margin_to_tolerance": CALIBRATED_TAIL[kind] - max(values),
        }
        for kind, values in found.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--microbatch", type=int, default=None, help="sequences per request (default: the run's)")
    args = parser.parse_args()
    run = load_config(args.preset)
    batches = requests(run, args.batches, args.microbatch or run.optim.microbatch_size)
    offload = tail_backend(run, "offload", True)
    pairings = {
        "offload_vs_fp32_layout_bf16_autocast": tail_backend(run, "fp32", True),  # a GPU's (8b mixes precision)
        "offload_vs_fp32_layout_fp32": tail_backend(run, "fp32", False),
    }
    report = {name: distances(offload, other, batches) for name, other in pairings.items()}
    for name, kinds in report.items():
        for kind, figures in kinds.items():
            print(
                f"{name} {kind}: max {figures['max']:.2e}, median {figures['median']:.2e}, tolerance "
                f"{figures['tolerance']} ({figures['fraction_of_tolerance']:.4f} of it)"
            )
    covered = all(figures["max"] <= figures["tolerance"] for kinds in report.values() for figures in kinds.values())
    print(
        json.dumps(
            {
                "bench": "layout_disagreement",
                "preset": run.name,
                "seq_len": run.model.seq_len,
                "batches": len(batches),
                "microbatch": batches[0][0].shape[0],
                "cpu_bf16_native": native_bf16(CPU),
                "random_answer_distance": math.sqrt(2),
                "pairings": report,
                "covered_by_tolerance": covered,
            }
        )
    )


if __name__ == "__main__":
    main()
