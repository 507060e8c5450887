"""What else runs on one card, and the energy it has used, through NVML (the GPU probe's handle and guards).

A process in another PID namespace (a container) may be listed with a pid this host cannot name: it still
counts, as "unknown". Where NVML cannot list processes at all (some virtualised GPUs) nobody is seen.
"""

from __future__ import annotations

import psutil

from agora_client.system.gpu import GpuProbe
from agora_client.system.gpu_yield import GpuUser


def own_pids() -> set[int]:
    """This process and every process it started (hivemind's helpers): the worker's own use of the card."""
    me = psutil.Process()
    return {me.pid, *(child.pid for child in me.children(recursive=True))}


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "unknown"


class GpuUsers:
    """The processes NVML lists on card ``index`` (nvidia-smi's number) and its energy counter."""

    def __init__(self, index: int | None, probe: GpuProbe | None = None) -> None:
        self.index = index
        self.probe = probe or GpuProbe()

    def users(self) -> list[GpuUser]:
        """Graphics users first (a process in both lists counts as graphics); empty without NVML or a card."""
        if self.index is None:
            return []
        found: dict[int, GpuUser] = {}
        for graphics, listing in (
            (True, "nvmlDeviceGetGraphicsRunningProcesses"),
            (False, "nvmlDeviceGetComputeRunningProcesses"),
        ):
            for process in self.probe.device_query(self.index, listing) or ():
                found.setdefault(process.pid, GpuUser(process.pid, _process_name(process.pid), graphics))
        return list(found.values())

    def energy_mj(self) -> int | None:
        """Millijoules the card has used since its driver loaded (Volta and newer), or None where it cannot say."""
        energy = (
            None if self.index is None else self.probe.device_query(self.index, "nvmlDeviceGetTotalEnergyConsumption")
        )
        return int(energy) if energy is not None else None

    def close(self) -> None:
        self.probe.close()
