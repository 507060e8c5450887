"""Preflight: what a contributor's machine and network look like to this swarm, checked before authorizing.

Each check returns a ``PreflightEvent`` (pass / warn / fail, the measured value, the reason). The
runtime emits them before it asks for a slot; the app shows them and ``--headless`` prints them as
``[PREFLIGHT]`` lines. Reachability is checked by the auth service during the join (``reachability_result``).
Memory and disk needs come from the smallest stage's memory plan (agora_client/model/memory.py), allocating
nothing: the stage is assigned later, and then checked itself; the GPU must pass the fit check's capability rule
(agora_client/joining/gpu_fit.py). The RAM need on a GPU is that of the stages in the layout the card takes each
in (the fit check's rule, model/memory.py card_layout): a stage the offload layout puts on a small card keeps its
fp32 masters in host RAM.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil

from agora_client.auth.reachability import DialResult
from agora_client.auth.run_description import RunDescription
from agora_client.auth.uplink_probe import UplinkProbeFailed, measure_uplink
from agora_client.describe import sparta_round
from agora_client.events import MACHINE_CHECKS, PreflightCheck, PreflightEvent
from agora_client.frontend.lines import human_bytes as human
from agora_client.joining.gpu_fit import GpuRefused, check_capability
from agora_client.model.memory import StagePlan, card_layout, choose_layout, plan_stage
from agora_client.model.stages import param_counts
from agora_client.network.outage import OUTAGE_STATUSES, is_outage
from agora_client.system.gpu import GpuSpec, probe_cuda_device

SLOW_DOWNLOAD_BPS = 5e6
SLOW_UPLOAD_BPS = 10e6 / 8  # 10 Mbit/s: below it, averaging rounds of any large stage run for minutes
SLOW_SEED_RTT_S = 0.25
_TCP_MADDR = re.compile(r"^/(ip4|ip6|dns4|dns6|dns)/([^/]+)/tcp/(\d+)")


def _smallest_plan(run: RunDescription) -> StagePlan:
    """The joiner does not know its stage before authorizing: a machine that cannot hold even the smallest stage
    is refused now; the assigned stage is checked once known (agora_client/joining/gpu_fit.py)."""
    return min(
        (plan_stage(run.config, stage) for stage in run.config.model.stage_names), key=lambda plan: plan.snapshot
    )


def _least_host_plan(run: RunDescription, gpu_memory: int | None) -> StagePlan:
    """The plan of the stage needing the least host RAM on this machine. On a GPU of ``gpu_memory`` bytes each stage
    is planned in the layout the card takes it in, among the stages it holds (all, if it holds none: the fit check
    refuses it later with its numbers); on the CPU, or a GPU of unknown size, in fp32."""
    config, stages = run.config, run.config.model.stage_names
    if gpu_memory is None:
        plans = [plan_stage(config, stage) for stage in stages]
    else:
        held = [stage for stage in stages if choose_layout(config, stage, gpu_memory) is not None] or stages
        plans = [plan_stage(config, stage, layout=card_layout(config, stage, gpu_memory)) for stage in held]
    return min(plans, key=lambda plan: plan.host_need(on_gpu=gpu_memory is not None))


def gpu_capacity(device: str) -> int | None:
    """What the fit check plans with on ``device`` (GpuSpec.capacity), or None for the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    spec = probe_cuda_device(torch.device(device).index or 0)
    return None if spec is None else spec.capacity


def check_gpu(device: str, note: str) -> PreflightEvent:
    if not device.startswith("cuda"):
        return PreflightEvent(check="gpu", status="warn", value="CPU", reason=f"{note}; a CPU worker is slow")
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    value = f"{props.name}, {human(props.total_memory)} VRAM, compute capability {props.major}.{props.minor}"
    try:
        check_capability(GpuSpec(props.name, int(props.total_memory), (props.major, props.minor)))
    except GpuRefused as refused:
        return PreflightEvent(check="gpu", status="fail", value=value, reason=str(refused))
    return PreflightEvent(check="gpu", status="pass", value=value, reason=note)


def check_host_ram(run: RunDescription, on_cpu: bool, gpu_memory: int | None = None) -> PreflightEvent:
    """``gpu_memory``: the card's (gpu_capacity), so that each stage is planned in the layout it takes there."""
    plan = _smallest_plan(run) if on_cpu else _least_host_plan(run, gpu_memory)
    need = plan.host_need(on_gpu=not on_cpu)
    available = psutil.virtual_memory().available
    return _headroom(
        "host_ram",
        available,
        need,
        f"{human(available)} available, about {human(need)} needed",
        fail=f"not enough free RAM even for the smallest stage ({plan.stage}, {plan.layout} layout): close other "
        "programs or use a larger machine",
        warn="little headroom beyond the stage itself",
    )


def check_disk(run: RunDescription, directory: Path) -> PreflightEvent:
    plan = _smallest_plan(run)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    return _headroom(
        "disk",
        free,
        plan.disk_need,
        f"{human(free)} free in {directory}, about {human(plan.disk_need)} needed",
        fail=f"not enough disk even for the smallest stage's snapshots ({plan.stage}): free space or "
        "pass another --config-dir",
        warn="little room left beyond the snapshots",
    )


def _headroom(check: PreflightCheck, have: int, need: int, value: str, *, fail: str, warn: str) -> PreflightEvent:
    """Fail below what is needed, warn below twice that, else pass."""
    if have < need:
        return PreflightEvent(check=check, status="fail", value=value, reason=fail)
    if have < 2 * need:
        return PreflightEvent(check=check, status="warn", value=value, reason=warn)
    return PreflightEvent(check=check, status="pass", value=value)


def check_download_rate(
    run: RunDescription, *, max_bytes: int = 8 << 20, max_s: float = 3.0, client: httpx.Client | None = None
) -> PreflightEvent:
    """Read up to ``max_bytes`` (for at most ``max_s``) of the head's snapshot from the swarm's snapshot server."""
    if not run.snapshot_url:
        return PreflightEvent(
            check="download_rate",
            status="warn",
            value="no snapshot server",
            reason="the swarm names no snapshot server: a joiner starts from fresh weights",
        )
    http = client or httpx.Client(timeout=10.0)
    try:
        url = _first_snapshot_file(http, run)
        received, started = 0, time.perf_counter()
        with http.stream("GET", url) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                received += len(chunk)
                if received >= max_bytes or time.perf_counter() - started >= max_s:
                    break
        seconds = max(time.perf_counter() - started, 1e-6)
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as error:
        if _is_outage(error):  # the snapshot server restarting: the download waits for it (network/outage.py)
            return PreflightEvent(
                check="download_rate",
                status="warn",
                value="unreachable",
                reason=f"the snapshot server did not answer ({type(error).__name__}): the download waits for it",
            )
        return PreflightEvent(
            check="download_rate",
            status="fail",
            value="unreadable",
            reason=f"could not download from the snapshot server ({type(error).__name__}); check your network",
        )
    finally:
        if client is None:
            http.close()
    rate = received / seconds
    value = f"{human(rate)}/s over {human(received)}"
    if rate < SLOW_DOWNLOAD_BPS:
        return PreflightEvent(
            check="download_rate", status="warn", value=value, reason="slow: the snapshot download will take a while"
        )
    return PreflightEvent(check="download_rate", status="pass", value=value)


def _is_outage(error: Exception) -> bool:
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code in OUTAGE_STATUSES
    return isinstance(error, httpx.HTTPError) and is_outage(error)


def check_upload_rate(run: RunDescription, swarm_url: str, **probe: float) -> PreflightEvent:
    """Time an upload to the auth service (``probe``: measure_uplink's limits) and say what a SPARTA round of this
    swarm's largest stage then takes: a worker sends about that much each way in every round."""
    try:
        measured = measure_uplink(swarm_url, **probe)
    except UplinkProbeFailed as error:
        return PreflightEvent(
            check="upload_rate",
            status="warn",
            value="not measured",
            reason=f"{error}; the worker measures its uplink in its averaging rounds",
        )
    rate = measured.bytes_per_s
    counts = param_counts(run.config.model)
    largest = max(counts, key=counts.__getitem__)
    moved, seconds = sparta_round(run.config, counts[largest], rate)
    value = f"{human(rate)}/s ({rate * 8 / 1e6:.0f} Mbit/s) over {human(measured.received)}"
    reason = (
        f"an averaging round of the largest stage ({largest}) sends {human(moved)} each way: "
        f"about {seconds:.0f} s at this rate"
    )
    return PreflightEvent(
        check="upload_rate",
        status="warn" if rate < SLOW_UPLOAD_BPS else "pass",
        value=value,
        reason=f"slow: {reason}" if rate < SLOW_UPLOAD_BPS else reason,
    )


def check_seed_rtt(run: RunDescription, timeout_s: float = 3.0) -> PreflightEvent:
    """TCP connect time to every seed; one answering seed is enough to join."""
    times: list[float] = []
    for seed in run.seeds:
        match = _TCP_MADDR.match(seed)
        if match is None:
            continue
        started = time.perf_counter()
        try:
            with socket.create_connection((match.group(2), int(match.group(3))), timeout=timeout_s):
                times.append(time.perf_counter() - started)
        except OSError:
            continue
    if not times:
        return PreflightEvent(
            check="seed_rtt",
            status="fail",
            value=f"0 of {len(run.seeds)} seeds answered",
            reason="no seed answered a TCP connect: check your network or firewall for outbound TCP",
        )
    best = min(times)
    value = f"{best * 1000:.0f} ms (best of {len(times)} of {len(run.seeds)} seeds answering)"
    if best > SLOW_SEED_RTT_S:
        return PreflightEvent(
            check="seed_rtt", status="warn", value=value, reason="far from the swarm: pipeline steps will be slow"
        )
    return PreflightEvent(check="seed_rtt", status="pass", value=value)


def reachability_result(dial: DialResult | None, port: int, how: str = "") -> PreflightEvent:
    """The reachability check's line; ``how`` says by which path the swarm reached the worker."""
    if dial is None:
        return PreflightEvent(
            check="reachability",
            status="warn",
            value=f"port {port}",
            reason="the swarm admitted this worker without dialing it back: other peers may not reach it",
        )
    if dial.reachable:
        how = f", {how}" if how else ""
        return PreflightEvent(
            check="reachability", status="pass", value=dial.address, reason=f"reached from {dial.tested_from}{how}"
        )
    return PreflightEvent(
        check="reachability",
        status="fail",
        value=dial.address,
        reason=f"not reachable from {dial.tested_from} ({dial.error})",
    )


def machine_checks(
    run: RunDescription, swarm_url: str, device: str, device_note: str, config_dir: Path
) -> list[Callable[[], PreflightEvent]]:
    """The checks that run before the join, in ``MACHINE_CHECKS`` order (reachability comes with the join)."""
    on_cpu = not device.startswith("cuda")
    checks: dict[PreflightCheck, Callable[[], PreflightEvent]] = {
        "gpu": lambda: check_gpu(device, device_note),
        "host_ram": lambda: check_host_ram(run, on_cpu=on_cpu, gpu_memory=gpu_capacity(device)),
        "disk": lambda: check_disk(run, config_dir),
        "download_rate": lambda: check_download_rate(run),
        "upload_rate": lambda: check_upload_rate(run, swarm_url),
        "seed_rtt": lambda: check_seed_rtt(run),
    }
    return [checks[name] for name in MACHINE_CHECKS]


def _first_snapshot_file(http: httpx.Client, run: RunDescription) -> str:
    """URL of the largest file of the head's latest snapshot."""
    base = run.snapshot_url.rstrip("/")
    latest = base.replace("{stage}", "head") if "{stage}" in base else f"{base}/head/latest.json"
    pointer = http.get(latest)
    pointer.raise_for_status()
    manifest_url = httpx.URL(latest).join(pointer.json()["manifest"])
    manifest = http.get(manifest_url)
    manifest.raise_for_status()
    files = manifest.json()["files"]
    name = max(files, key=lambda item: files[item]["size"])
    return str(manifest_url.join(name))
