"""Join-time check, before any download: can this machine hold the assigned stage, and how many sequences per pass?

The decision comes from the stage's memory plan (agora_client/model/memory.py), the same numbers
``agora describe`` prints: the GPU's free memory (NVML) against the stage's peak, the host's available RAM
and the config dir's free disk against what the stage keeps there. ``--batch-size-override N`` may only
lower the microbatch the plan allows.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import psutil

from agora_client.config import RunConfig
from agora_client.events import EventWriter
from agora_client.model.memory import (
    CUDA_RESERVED_BYTES,
    StagePlan,
    card_layout,
    gib,
    largest_microbatch,
    plan_stage,
    usable_bytes,
)
from agora_client.system.gpu import GpuSpec, probe_cuda_device

if TYPE_CHECKING:  # a type only: auth's client loads hivemind, which the fit check (bench/gpu_check.py) must not
    from agora_client.auth.client import StageAssignment

MIN_CAPABILITY = (8, 0)


class StageRefused(RuntimeError):
    """This machine cannot serve the run or its assigned stage.

    The message says why, with the numbers, and what to do."""


class GpuRefused(StageRefused):
    """The GPU is too old or too small."""


class HostRefused(StageRefused):
    """The host has too little free RAM or disk for the assigned stage."""


def check_capability(gpu: GpuSpec) -> None:
    if gpu.capability < MIN_CAPABILITY:
        major, minor = gpu.capability
        raise GpuRefused(
            f"{gpu.name} has compute capability {major}.{minor}; workers need 8.0 or newer, i.e. native BF16 "
            "tensor cores (A100, H100, L40S, RTX 3090/4090 and similar). Cards without them, such as the T4 "
            "and V100, would emulate BF16 and run slower than FP32. Choose another GPU with --gpu."
        )


@dataclass(frozen=True)
class FitDecision:
    microbatch: int  # sequences per pass this worker takes (its backend's max batch size)
    largest: int  # what the GPU could hold
    plan: StagePlan  # at `microbatch`, in the layout the card takes the stage in

    @property
    def layout(self) -> str:
        return self.plan.layout


def fit_stage(run: RunConfig, stage: str, gpu: GpuSpec, *, override: int | None = None) -> FitDecision:
    check_capability(gpu)
    layout = card_layout(run, stage, gpu.capacity)
    largest = largest_microbatch(run, stage, gpu.capacity, layout=layout)
    if largest < 1:
        plan = plan_stage(run, stage, 1, layout=layout)
        raise GpuRefused(
            f"{gpu.name} cannot hold stage {stage}: one sequence of {run.model.seq_len} tokens needs "
            f"{gib(plan.gpu_peak)} of GPU memory (weights {gib(plan.weights)}, gradients {gib(plan.gradients)}, "
            f"saved activations {gib(plan.saved_activations)}, backward {gib(plan.backward_transient)}), and "
            f"the card has {gib(gpu.memory_total)} ({gib(gpu.capacity)} free), {gib(usable_bytes(gpu.capacity))} "
            f"usable after {gib(CUDA_RESERVED_BYTES)} for CUDA itself. Use a GPU with more memory."
        )
    if override is not None and not 1 <= override <= largest:
        raise GpuRefused(
            f"--batch-size-override {override} is outside 1..{largest}: {gpu.name} holds at most {largest} "
            f"sequences per pass on stage {stage}; the override may only lower that"
        )
    chosen = override if override is not None else largest
    if chosen < run.optim.microbatch_size:
        raise GpuRefused(
            f"the run sends {run.optim.microbatch_size} sequences per request, but this worker would take at most "
            f"{chosen} on stage {stage} ({gpu.name}, {gib(gpu.capacity)} free); use a larger GPU or drop the override"
        )
    return FitDecision(chosen, largest, plan_stage(run, stage, chosen, layout=layout))


def check_host(
    run: RunConfig, stage: str, *, on_gpu: bool, ram_available: int, disk_free: int, layout: str = "fp32"
) -> None:
    """Refuse a stage whose host RAM or disk needs (from its memory plan in ``layout``) exceed what this machine has
    free."""
    plan = plan_stage(run, stage, layout=layout)
    ram = plan.host_need(on_gpu)
    if ram_available < ram:
        kept = "AdamW's moments and SPARTA's buffers" if on_gpu else "the whole stage (a CPU worker)"
        if layout == "offload":
            kept = "its fp32 master weights, gradient sum and staging, AdamW's moments and SPARTA's buffers"
        raise HostRefused(
            f"stage {stage} keeps {gib(ram)} in host memory ({kept}); this machine has {gib(ram_available)} available. "
            "Close other programs or use a machine with more RAM."
        )
    if disk_free < plan.disk_need:
        raise HostRefused(
            f"stage {stage} needs {gib(plan.disk_need)} of disk (its {gib(plan.snapshot)} snapshot and room for the "
            f"next one); the config dir has {gib(disk_free)} free. Free space or pass another --config-dir."
        )


class JoinFit:
    """The contributor's check: capability as soon as it starts, the stage's fit once the stage is assigned.

    :param capacity: judge the GPU as a card of this many bytes (a larger card held to a torch memory fraction)
    """

    def __init__(
        self,
        run: RunConfig,
        gpu_index: int | None,
        override: int | None,
        events: EventWriter,
        *,
        disk_dir: Path,
        capacity: int | None = None,
        probe: Callable[[int], GpuSpec | None] = probe_cuda_device,
    ):
        self.run, self.override, self.events, self.disk_dir = run, override, events, Path(disk_dir)
        self.gpu = probe(gpu_index) if gpu_index is not None else None  # None: a CPU worker, nothing to check
        if self.gpu is not None and capacity is not None:
            self.gpu = self.gpu.limited_to(capacity)
        if self.gpu is not None:
            check_capability(self.gpu)
        self.max_batch_size: int | None = None  # set by check(); None keeps the worker's default
        self.layout = "fp32"  # set by check(): the layout the GPU takes the stage in

    def check(self, stage: str) -> None:
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        decision = None if self.gpu is None else fit_stage(self.run, stage, self.gpu, override=self.override)
        check_host(
            self.run,
            stage,
            on_gpu=self.gpu is not None,
            ram_available=psutil.virtual_memory().available,
            disk_free=shutil.disk_usage(self.disk_dir).free,
            layout="fp32" if decision is None else decision.layout,
        )
        if decision is None:
            return
        self.max_batch_size, self.layout = decision.microbatch, decision.layout
        self.events.log(
            f"{self.gpu.name} ({gib(self.gpu.capacity)} free) holds stage {stage}: up to {decision.largest} sequences "
            f"per pass, taking {decision.microbatch} (planned peak {gib(decision.plan.gpu_peak)}, "
            f"host {gib(decision.plan.host)}, {decision.layout} layout)",
            tag="GPU",
        )

    def guard(self, start: Callable[[StageAssignment, str], None]) -> Callable[[StageAssignment], None]:
        """Wraps the stage preparation's start: the stage is checked before anything is fetched or built for it, and
        built in the layout the check chose (its second argument)."""

        def checked(assignment: StageAssignment) -> None:
            self.check(assignment.stage)
            start(assignment, self.layout)

        return checked
