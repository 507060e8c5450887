"""The sections of bench/gpu_check.py other than the stage runs (a helper of it, not a bench): the device's facts
with NVML's view of the same card, the card a stage is fitted to (and a smaller one emulated), the numerics
(a stage's BF16 forward against FP32, E_f rows hashed on the device against the CPU) and the pinned copy rate.

Imports nothing that loads hivemind.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import replace

import psutil
import torch
from _gpu_stage_run import release, stage_inputs, synchronize

from agora_client.config import RunConfig
from agora_client.joining.gpu_fit import MIN_CAPABILITY, GpuRefused, fit_stage
from agora_client.model import build_stage
from agora_client.model.layers import native_bf16
from agora_client.model.memory import CUDA_RESERVED_BYTES, LAYOUTS, card_layout, gib, plan_stage, usable_bytes
from agora_client.model.subspace import fixed_embedding_rows
from agora_client.system.cuda_allocator import ALLOC_CONF
from agora_client.system.gpu import (
    CardId,
    GpuProbe,
    GpuSpec,
    cuda_card_ids,
    match_cuda_index,
    nvml_card_id,
    nvml_free_memory,
    probe_cuda_device,
)

HOME_CARD_BYTES = 24 * 2**30  # the card a contributor most often has (RTX 3090 / 4090): every stage, the tail offloaded
SMALL_CARD_BYTES = 16 * 2**30  # a smaller home card (RTX 4080, 4060 Ti 16 GB): a body, never the tail
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # per direction and repeat
COPY_REPEATS = 5  # after one warm-up copy; the fastest is reported


def _cpu_name() -> str:
    return f"CPU {platform.processor() or platform.machine()}"


def nvml_view(card: CardId | None) -> dict:
    """NVML's driver facts, and its view of ``card`` (the card CUDA calls it, found by UUID, else PCI address)."""
    probe = GpuProbe()
    try:
        if not probe.available:
            return {"available": False, "note": probe.note}
        facts = {
            "available": True,
            "driver": probe.driver_version(),
            "cuda_driver": probe.cuda_driver_version(),
            "devices": probe.count(),
        }
        for index in range(probe.count() if card is not None else 0):
            seen = nvml_card_id(probe, index)
            if seen is None or match_cuda_index(seen, [card]) != 0:
                continue
            sample = probe.sample(index)
            return {
                **facts,
                "index": index,
                "uuid": seen.uuid,
                "matched_by": "uuid" if seen.uuid and seen.uuid == card.uuid else "pci",
                "name": sample.name if sample else None,
                "memory_total": sample.memory_total if sample else None,
                "memory_free": nvml_free_memory(card),
            }
        if card is None:
            return {**facts, "matched_by": None, "note": "no CUDA device to match"}
        return {
            **facts,
            "matched_by": None,
            "note": f"no NVML device has the UUID {card.uuid} or PCI address {card.pci} CUDA reports",
        }
    finally:
        probe.close()


def device_facts(device: torch.device) -> dict:
    common = {
        "torch": torch.__version__,
        "bf16_native": native_bf16(device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "allocator": os.environ.get(ALLOC_CONF),
    }
    if device.type != "cuda":
        return {
            "kind": "cpu",
            "name": _cpu_name(),
            "cores": psutil.cpu_count(),
            "memory_total": psutil.virtual_memory().total,
            **common,
            "nvml": nvml_view(None),
        }
    props = torch.cuda.get_device_properties(device)
    card = cuda_card_ids()[device.index]
    return {
        "kind": "cuda",
        "index": device.index,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_total": props.total_memory,
        "multiprocessors": props.multi_processor_count,
        "uuid": card.uuid,
        "cuda_runtime": torch.version.cuda,
        **common,
        "nvml": nvml_view(card),
    }


def card_of(device: torch.device) -> GpuSpec:
    """What the join-time fit check sees: the GPU (NVML's free memory), or on the CPU its RAM as a card."""
    if device.type == "cuda":
        return probe_cuda_device(device.index)
    return GpuSpec(f"{_cpu_name()} (--dry: its RAM judged as a card)", psutil.virtual_memory().total, MIN_CAPABILITY)


def _peak(run: RunConfig, stage: str, layout: str, microbatch: int | None = None) -> int:
    return plan_stage(run, stage, microbatch, layout=layout).gpu_peak


def dry_card_bytes(run: RunConfig, home: bool) -> int:
    """--dry's cards for a small preset, which the fit check then decides on as it does on the 8b's 24 and 16 GiB
    cards. Home: halfway between what holds every head and body in fp32 and the tail in the offload layout, and the
    tail's fp32 peak (so that the tail takes the offload layout). Small: halfway between the first body's least peak
    (in the layout that holds the most) and the tail's in that layout (so that a body trains and the tail is
    refused). Peaks at the run's microbatch, which --dry trains at."""
    stages, last = run.model.stage_names, LAYOUTS[-1]
    if home:
        holds = max(*(_peak(run, stage, "fp32") for stage in stages if stage != "tail"), _peak(run, "tail", last))
        refused = _peak(run, "tail", "fp32")
    else:
        holds, refused = _peak(run, stages[1], last), _peak(run, "tail", last)
    if holds >= refused:
        raise ValueError(
            f"preset {run.name}: no {'home' if home else 'small'} card holds what it should ({gib(holds)}) without "
            f"what it should not ({gib(refused)}); --dry needs a preset whose tail is the largest stage"
        )
    return CUDA_RESERVED_BYTES + (holds + refused) // 2


def emulated_card(run: RunConfig, card: GpuSpec, dry: bool, home: bool) -> GpuSpec:
    """``card`` judged as a home (24 GiB) or small (16 GiB) one, as the contributor's JoinFit does with its
    ``capacity`` override."""
    capacity = dry_card_bytes(run, home) if dry else HOME_CARD_BYTES if home else SMALL_CARD_BYTES
    return replace(card.limited_to(capacity), name=f"{card.name} held to {gib(capacity)}")


@contextlib.contextmanager
def allocator_cap(device: torch.device, card_bytes: int) -> Iterator[dict]:
    """On a larger GPU, torch's allocator held to what a card of ``card_bytes`` leaves it: the card less what
    is outside the allocator here (CUDA's context, other programs), which a real card loses too."""
    if device.type != "cuda":
        yield {"capped": False, "note": "CPU: no allocator to cap; the fit check decides with the card's numbers"}
        return
    release(device)
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    fraction = (card_bytes - outside) / total
    if fraction >= 1:
        yield {"capped": False, "note": f"the card ({gib(total)}) is no larger than {gib(card_bytes)}"}
        return
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield {
            "capped": True,
            "fraction": fraction,
            "allocator_limit": int(fraction * total),
            "outside_allocator": outside,
        }
    finally:
        release(device)
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def tail_refusal(run: RunConfig, card: GpuSpec) -> dict:
    """The join-time fit check on the tail for ``card``: refused, with the plan's numbers in the layout the card
    would take it in, or the microbatch it took."""
    layout = card_layout(run, "tail", card.capacity)
    facts = {
        "layout": layout,
        "planned_peak_one_sequence": _peak(run, "tail", layout, 1),
        "planned_peak": _peak(run, "tail", layout),
        "usable": usable_bytes(card.capacity),
    }
    try:
        decision = fit_stage(run, "tail", card)
    except GpuRefused as refusal:
        return {"refused": True, "reason": str(refusal), **facts}
    return {"refused": False, "microbatch": decision.microbatch, **facts}


def bf16_against_fp32(run: RunConfig, device: torch.device) -> dict:
    """The first body's forward at one sequence, under BF16 autocast against FP32: ||bf16 - fp32|| / ||fp32||."""
    stage = run.model.stage_names[1]
    module = build_stage(run.model, stage, seed=run.seed, device=device)
    inputs = stage_inputs(module, 1, device)
    with torch.no_grad():
        reference = module(*inputs).float()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            mixed = module(*inputs).float()
    error = float((mixed - reference).norm() / reference.norm())
    return {"stage": stage, "tokens": run.model.seq_len, "relative_error": error, "bf16_native": native_bf16(device)}


def hashed_rows_against_cpu(run: RunConfig, device: torch.device) -> dict:
    """E_f rows hashed on ``device`` (torch.unique, integer hashing, Box-Muller there) against the CPU's."""
    config = run.model
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, config.vocab_size, (4, 256), generator=generator)
    tokens[0, :2] = torch.tensor([0, config.vocab_size - 1])
    tokens[1] = tokens[0]  # repeated rows: the device's torch.unique must map them back through its inverse
    on_device = fixed_embedding_rows(tokens.to(device), config.d_model, config.init_std, run.seed).cpu()
    on_cpu = fixed_embedding_rows(tokens, config.d_model, config.init_std, run.seed)
    return {
        "device": str(device),
        "rows": tokens.numel(),
        "distinct": int(tokens.unique().numel()),
        "bitwise_equal": torch.equal(on_device, on_cpu),
        "max_abs_diff": float((on_device - on_cpu).abs().max()),
        # a few float32 ulps of cos and log apart is the same row; the integer hash itself is exact
        "close": bool(torch.allclose(on_device, on_cpu, rtol=1e-5, atol=1e-6 * config.init_std)),
    }


def _fastest_copy(device: torch.device, copy) -> float:
    copy()
    synchronize(device)
    seconds = []
    for _ in range(COPY_REPEATS):
        started = time.perf_counter()
        copy()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def pinned_copy_rate(device: torch.device) -> dict:
    """GB/s of a pinned host buffer copied to the device and back, what the offloaded AdamW's chunks ride on."""
    size = COPY_BYTES[device.type]
    if device.type != "cuda":
        source, target = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        rate = size / _fastest_copy(device, lambda: target.copy_(source)) / 1e9
        return {
            "bytes": size,
            "pinned": False,
            "host_to_device_gb_s": rate,
            "device_to_host_gb_s": rate,
            "note": "CPU: a host memory copy, no PCIe",
        }
    host = torch.ones(size, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    to_device = _fastest_copy(device, lambda: on_device.copy_(host, non_blocking=True))
    to_host = _fastest_copy(device, lambda: host.copy_(on_device, non_blocking=True))
    return {
        "bytes": size,
        "pinned": host.is_pinned(),
        "host_to_device_gb_s": size / to_device / 1e9,
        "device_to_host_gb_s": size / to_host / 1e9,
    }
