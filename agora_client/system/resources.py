"""One `resources` event from the GPU and host probes, for the runtime to emit periodically."""

from __future__ import annotations

from agora_client.events import ResourcesEvent
from agora_client.system.gpu import GpuProbe
from agora_client.system.host import HostProbe


class ResourceProbe:
    """Samples the chosen GPU (or explains its absence) and the worker's memory."""

    def __init__(self, gpu_index: int | None, pid: int | None = None, gpu: GpuProbe | None = None) -> None:
        self._gpu = gpu or GpuProbe()
        self._gpu_index = gpu_index
        self._host = HostProbe(pid)

    def sample(self) -> ResourcesEvent:
        gpu = self._gpu.sample(self._gpu_index) if self._gpu_index is not None else None
        note = ""
        if gpu is None:
            note = self._gpu.note or "no GPU selected: showing worker and host memory"
        used, total = self._host.host_ram()
        return ResourcesEvent(
            gpu=gpu,
            gpu_note=note,
            process_rss=self._host.process_tree_rss(),
            host_ram_used=used,
            host_ram_total=total,
            cpu_percent=self._host.cpu_percent(),
        )
