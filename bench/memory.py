"""Measured peak memory of one stage step against the memory plan (agora_client/model/memory.py).

One stage step is what a worker does: a backward request (the forward re-run under the run's
autocast, then backward, accumulating into fp32 gradients already there from earlier requests of
the epoch), then the optimizer step (OffloadAdamW, moments on the host when the run offloads them).
The peak over both is compared with the plan.

- CUDA (default when a GPU is present): the 8b preset; the peak is torch.cuda.max_memory_allocated.
  Stages whose plan exceeds the card are reported as skipped, with their planned bytes.
- CPU: a scaled 8b (every width / 8, sequence 512, same layer split and GQA ratio); the peak is the
  CPU allocator's, from the profiler's running "Total Allocated" over the step, plus the bytes the
  stage's tensors held when the step began (weights, frozen basis, gradients; moments if not offloaded).

Usage: python bench/memory.py [--device cuda|cpu] [--stages head,body1,tail] [--microbatch N] [--fp32] [--no-offload]
The last line is one JSON object: per stage the measured and planned peaks and their ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.utils.tensor_descr import BatchTensorDescriptor
from torch.profiler import ProfilerActivity, profile

from agora_client.config import RunConfig, load_config
from agora_client.model import build_stage
from agora_client.model.memory import gib, plan_stage, usable_bytes
from agora_client.serving.backend import autocast_context
from agora_client.worker.optimizer import build_optimizer

# The 8b preset with every width divided by 8 (head dim and the layer split kept): fits a CPU run.
SCALED_8B = {
    "name": "8b-scaled",
    "model": {"d_model": 640, "n_heads": 5, "n_kv_heads": 1, "ffn_hidden": 2304, "vocab_size": 16032, "seq_len": 512},
}


def _inputs(module, run: RunConfig, microbatch: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.model.vocab_size, (microbatch, run.model.seq_len), generator=generator).to(device)
    if module.stage == "head":
        inputs: tuple[torch.Tensor, ...] = (tokens,)
    else:
        boundary = torch.randn(microbatch, run.model.seq_len, module.boundary_width, generator=generator).to(device)
        inputs = (boundary, tokens, tokens) if module.stage == "tail" else (boundary, tokens)
    with torch.no_grad():
        output = module(*inputs)
    return inputs, torch.randn(output.shape, generator=generator).to(device) * 1e-3


def _tensor_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def _resident_bytes(module, optimizer, offload: bool) -> int:
    """Bytes the stage's own tensors hold on its device right now."""
    tensors = [*module.parameters(), *module.buffers(), *(p.grad for p in module.parameters() if p.grad is not None)]
    if not offload:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return _tensor_bytes(tensors)


class PeakMeter:
    """The device allocator's peak over a window: CUDA's counter, or the profiler's running total on the CPU."""

    def __init__(self, device: torch.device, module, optimizer, offload: bool):
        self.device, self.module, self.optimizer, self.offload = device, module, optimizer, offload

    def measure(self, work) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            work()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        before = _resident_bytes(self.module, self.optimizer, self.offload)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            work()
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            profiler.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        totals = [event["args"]["Total Allocated"] for event in events if event.get("name") == "[memory]"]
        return before + max(totals, default=0)


def measure_stage(run: RunConfig, stage: str, microbatch: int, device: torch.device) -> dict:
    plan = plan_stage(run, stage, microbatch)
    module = build_stage(run.model, stage, seed=0, device=device)
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(parameters, run)
    inputs, grad_output = _inputs(module, run, microbatch, device)
    backend = ModuleBackend(
        stage,
        module,
        args_schema=tuple(BatchTensorDescriptor.from_tensor(t) for t in inputs),
        outputs_schema=BatchTensorDescriptor.from_tensor(grad_output),
        min_batch_size=1,
        max_batch_size=microbatch,
    )
    autocast = autocast_context(device, run.use_mixed_precision)

    def backward_request() -> None:  # what StageBackend.backward runs: forward again, then backward
        with autocast():
            backend.backward(*inputs, grad_output)

    def optimizer_step() -> None:  # what EpochController._step runs
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    backward_request()  # warm-up: kernels, the optimizer's moments
    optimizer_step()
    backward_request()  # gradients now accumulate: the state of a worker for all but the first request of an epoch
    meter = PeakMeter(device, module, optimizer, run.offload_optimizer)
    backward_peak = meter.measure(backward_request)
    step_peak = meter.measure(optimizer_step)
    measured = max(backward_peak, step_peak)
    return {
        "stage": stage,
        "microbatch": microbatch,
        "measured_peak": measured,
        "measured_backward_peak": backward_peak,
        "measured_step_peak": step_peak,
        "planned_peak": plan.gpu_peak,
        "ratio": measured / plan.gpu_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stages", default="head,body1,tail", help="comma-separated stage names")
    parser.add_argument("--microbatch", type=int, default=None, help="sequences per pass (default: the run's)")
    parser.add_argument("--fp32", action="store_true", help="use_mixed_precision: false")
    parser.add_argument("--no-offload", action="store_true", help="offload_optimizer: false (moments on the device)")
    args = parser.parse_args()
    device = torch.device(args.device)
    switches = {"use_mixed_precision": not args.fp32, "offload_optimizer": not args.no_offload}
    run = load_config("8b", switches) if device.type == "cuda" else load_config("8b", {**SCALED_8B, **switches})
    microbatch = args.microbatch or run.optim.microbatch_size
    results, skipped = [], []
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for stage in args.stages.split(","):
        planned = plan_stage(run, stage, microbatch).gpu_peak
        if capacity is not None and planned > usable_bytes(capacity):
            print(f"{stage}: skipped, planned peak {gib(planned)} exceeds this card's usable {gib(usable_bytes(capacity))}")
            skipped.append({"stage": stage, "planned_peak": planned})
            continue
        result = measure_stage(run, stage, microbatch, device)
        print(
            f"{stage}: measured peak {gib(result['measured_peak'])} (backward {gib(result['measured_backward_peak'])}, "
            f"optimizer step {gib(result['measured_step_peak'])}), planned {gib(result['planned_peak'])}, "
            f"ratio {result['ratio']:.3f}"
        )
        results.append(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({
        "device": str(device),
        "preset": run.name,
        "mixed_precision": run.use_mixed_precision,
        "offload_optimizer": run.offload_optimizer,
        "stages": results,
        "skipped": skipped,
        "max_ratio": max((r["ratio"] for r in results), default=None),
    }))


if __name__ == "__main__":
    main()
