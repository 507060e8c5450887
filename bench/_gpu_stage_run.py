"""One stage trained as a worker trains it, measured (a helper of bench/gpu_check.py, not a bench).

The stage is built in a background thread, as a contributor's StagePreparation builds it while the snapshot
downloads, and warmed up as prepare_stage does. Then, at a given microbatch, under the worker's
autocast (bf16 where the run asks for it and the device runs it natively: agora_client/model/layers.py
autocast_context): a forward request, a backward request that re-runs the forward with autograd as hivemind's
ModuleBackend.backward does, and the epoch's optimizer step (gradient clipping, then OffloadAdamW, its moments
in pinned host memory when the run offloads them). Measured: peak device memory against the memory plan, the
time of a forward plus a backward request, tokens/s, MFU, and the optimizer step on its own.

In the offload layout (agora_client/model/memory.py LAYOUTS, a card the fp32 layout does not fit) the stage is
built on the host and the requests run on its bf16 device copy (agora_client/serving/device_copy.py) under bf16
autocast, as agora_client/serving/backend.py runs them: the copy refreshed before a request, each backward's
gradients streamed to the host and added into the masters' fp32 sum; the optimizer step runs on the host, then the
copy takes the new weights (timed with the step).

Imports nothing that loads hivemind: this runs on a GPU machine that has only torch and a few wheels.
"""

from __future__ import annotations

import gc
import math
import re
import statistics
import threading
import time
from typing import Any, Callable

import torch

from agora_client.config import RunConfig
from agora_client.model import StageModule, build_stage, trainable_parameter_count
from agora_client.model.layers import autocast_context, native_bf16
from agora_client.model.memory import plan_stage
from agora_client.serving.device_copy import DeviceCopy
from agora_client.worker.optimizer import build_optimizer

TIMED_REQUESTS = 3  # forward and backward requests timed after the warm-up; the median of each is reported

# Dense BF16 tensor-core peaks (TFLOPS, without sparsity) by device name; the first pattern found wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"L40S", 362.0),
    (r"RTX 4090", 165.0),
    (r"RTX 3090", 71.0),
    (r"\bA10\b", 125.0),  # not the A100, nor the A10G
    (r"\bL4\b", 121.0),  # not the L40 or L40S
)


def peak_bf16_flops(device_name: str) -> tuple[float | None, str]:
    """(the card's dense BF16 peak in FLOP/s or None, what it was taken for or why it is unknown)."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops * 1e12, f"{device_name}: {tflops:g} TFLOPS dense BF16 (matched {pattern!r})"
    return None, f"no BF16 peak known for {device_name!r}: add it to PEAK_BF16_TFLOPS in bench/_gpu_stage_run.py"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give what the dropped stages held back to the card, so the next measurement starts from nothing."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: torch.device) -> tuple[int | None, int | None]:
    """(max allocated, max reserved) by torch's CUDA allocator since the last reset; (None, None) on the CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def timed(device: torch.device, work: Callable[[], Any]) -> tuple[Any, float]:
    synchronize(device)
    started = time.perf_counter()
    result = work()
    synchronize(device)
    return result, time.perf_counter() - started


def build_in_background(
    run: RunConfig, stage: str, device: torch.device, layout: str = "fp32"
) -> tuple[StageModule, DeviceCopy | None, float]:
    """The stage built in a thread of its own and warmed up, as prepare_stage does (agora_client/worker/
    prepared_stage.py, started by joining/preparation.py); (masters, device copy, seconds). In the offload layout
    the masters are built on the host and the worker's device copy (worker/node.py) takes their weights."""
    outcome: dict[str, Any] = {}

    def build() -> None:
        try:
            module = build_stage(run.model, stage, seed=run.seed, device="cpu" if layout == "offload" else device)
            copy = DeviceCopy(module, run.model, device, seed=run.seed) if layout == "offload" else None
            if copy is None:
                module.warm_up(run.use_mixed_precision)  # prepare_stage's: the first forward's costs paid here
            else:
                copy.refresh()
            synchronize(device)
            outcome["stage"] = module, copy
        except Exception as error:  # raised again in the waiting thread, as StagePreparation does
            outcome["error"] = error

    started = time.perf_counter()
    thread = threading.Thread(target=build, name=f"stage build {stage}", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return *outcome["stage"], time.perf_counter() - started


def stage_inputs(module: StageModule, microbatch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """What a trainer sends the stage: token ids, and a boundary of the scale a head sends (init_std)."""
    config = module.config
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (microbatch, config.seq_len), generator=generator)
    if module.stage == "head":
        return (tokens.to(device),)
    boundary = torch.randn(microbatch, config.seq_len, module.boundary_width, generator=generator) * config.init_std
    inputs = (boundary, tokens, tokens.roll(-1, dims=1)) if module.stage == "tail" else (boundary, tokens)
    return tuple(tensor.to(device) for tensor in inputs)


class StageRequests:
    """A worker's forward and backward requests on one microbatch, each asserting the autocast it runs under; with
    ``copy`` (the offload layout) on the device copy, as StageBackend runs them there."""

    def __init__(
        self,
        module: StageModule,
        inputs: tuple[torch.Tensor, ...],
        device: torch.device,
        mixed_precision: bool,
        copy: DeviceCopy | None = None,
    ):
        self.module, self.inputs, self.device, self.copy = module if copy is None else copy.module, inputs, device, copy
        self.autocast = autocast_context(device, mixed_precision) if copy is None else copy.autocast
        # a GPU must run the run's bf16; a CPU without native bf16 computes in fp32, as its worker does; the device
        # copy is bf16 whatever the device
        self.require_bf16 = copy is not None or (mixed_precision and (device.type == "cuda" or native_bf16(device)))
        self.autocast_dtype: str | None = None
        self._grad_output: torch.Tensor | None = None

    def _check_autocast(self) -> None:
        kind = self.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        if self.require_bf16 and dtype != torch.bfloat16:
            raise AssertionError(
                f"BF16 autocast is off on {self.device} (autocast dtype {dtype}): the run asks for mixed precision "
                "and workers need native BF16 (compute capability 8.0 or newer)"
            )
        self.autocast_dtype = str(dtype or torch.float32).removeprefix("torch.")

    def forward(self) -> torch.Tensor:
        if self.copy is not None:
            self.copy.refresh()
        with torch.no_grad(), self.autocast():
            self._check_autocast()
            return self.module(*self.inputs).float()

    def backward(self) -> tuple[torch.Tensor, ...]:
        """The forward again with autograd, then backward; parameter gradients accumulate (offload: streamed to the
        host and added into the masters' sum), input gradients return."""
        if self.copy is not None:
            self.copy.refresh()
        with torch.enable_grad(), self.autocast():
            self._check_autocast()
            args = [t.detach().requires_grad_(True) if t.is_floating_point() else t for t in self.inputs]
            output = self.module(*args)
            torch.autograd.backward((output,), grad_tensors=(self._grad_for(output),))
        if self.copy is not None:
            self.copy.collect_gradients()
        return tuple(arg.grad for arg in args if arg.is_floating_point())

    def _grad_for(self, output: torch.Tensor) -> torch.Tensor:
        if self._grad_output is None:
            if output.dim() == 1:  # the tail's per-sample losses: the trainer's mean over the microbatch
                self._grad_output = torch.full_like(output, 1.0 / output.numel())
            else:
                generator = torch.Generator().manual_seed(1)
                self._grad_output = (torch.randn(output.shape, generator=generator) * 1e-3).to(output.device)
        return self._grad_output.to(output.dtype)


def optimizer_step(
    run: RunConfig, stage: str, parameters: list[torch.nn.Parameter], optimizer, copy: DeviceCopy | None = None
) -> float:
    """The epoch's step as agora_client/worker/epochs.py takes it (offload: on the host masters, then the device copy
    takes the new weights); returns the gradient norm before clipping."""
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, run.clip_norm(stage)))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if copy is not None:
        copy.refresh()
    return norm


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)


def _requests_timed(device: torch.device, requests: StageRequests) -> dict:
    """TIMED_REQUESTS forward and backward requests, gradients accumulating as they do within a stage epoch."""
    forwards, backwards, finite = [], [], True
    for _ in range(TIMED_REQUESTS):
        output, seconds = timed(device, requests.forward)
        forwards.append(seconds)
        grads, seconds = timed(device, requests.backward)
        backwards.append(seconds)
        finite = finite and _all_finite([output, *grads])
    loss = float(output.mean()) if output.dim() == 1 else None
    return {
        "forward_s": statistics.median(forwards),
        "backward_s": statistics.median(backwards),
        "outputs_finite": finite,
        "loss": loss,
    }


def _throughput(parameters: int, tokens: int, seconds: float, peak_flops: float | None, peak_note: str) -> dict:
    """tokens/s of a forward plus a backward request, and MFU: 6 x parameters x tokens of useful work (the
    backward's recomputed forward is not counted) over the card's dense BF16 peak."""
    mfu = None if peak_flops is None else 6 * parameters * tokens / seconds / peak_flops
    return {"tokens_per_s": tokens / seconds, "mfu": mfu, "mfu_note": peak_note}


def _against_plan(run: RunConfig, stage: str, microbatch: int, device: torch.device, layout: str) -> dict:
    planned = plan_stage(run, stage, microbatch, layout=layout).gpu_peak
    allocated, reserved = peaks(device)
    return {
        "planned_peak": planned,
        "peak_allocated": allocated,
        "peak_reserved": reserved,
        "peak_vs_plan": None if allocated is None else allocated / planned,
        "reserved_vs_plan": None if reserved is None else reserved / planned,
    }


def measure_stage(
    run: RunConfig,
    stage: str,
    microbatch: int,
    device: torch.device,
    peak: tuple[float | None, str],
    layout: str = "fp32",
) -> dict:
    """Build ``stage`` in ``layout``, warm it up (one forward, backward and optimizer step), then measure as the
    module says."""
    release(device)
    module, copy, build_s = build_in_background(run, stage, device, layout)
    build_peak, _ = peaks(device)
    parameters = [param for param in module.parameters() if param.requires_grad]
    optimizer = build_optimizer(parameters, run)
    inputs = stage_inputs(module, microbatch, device)
    requests = StageRequests(module, inputs, device, run.use_mixed_precision, copy)
    requests.forward()
    requests.backward()
    optimizer_step(run, stage, parameters, optimizer, copy)  # also allocates the moments (pinned when offloaded)
    if device.type == "cuda":  # the window starts from what a worker holds between epochs, its allocator's cache kept
        torch.cuda.reset_peak_memory_stats(device)
    measured = _requests_timed(device, requests)
    grad_norm, step_s = timed(device, lambda: optimizer_step(run, stage, parameters, optimizer, copy))
    tokens, count = microbatch * run.model.seq_len, trainable_parameter_count(module)
    step = measured["forward_s"] + measured["backward_s"]
    return {
        "stage": stage,
        "layout": layout,
        "microbatch": microbatch,
        "tokens": tokens,
        "parameters": count,
        "autocast": requests.autocast_dtype,
        "build_s": build_s,
        "build_peak_allocated": build_peak,
        **measured,
        "step_s": step,
        **_throughput(count, tokens, step, *peak),
        "optimizer_step_s": step_s,
        "grad_norm": grad_norm,
        "finite": measured["outputs_finite"] and math.isfinite(grad_norm),
        **_against_plan(run, stage, microbatch, device, layout),
    }
