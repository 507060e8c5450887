"""GPU name, memory and utilization; without an NVIDIA driver, the worker's and host's memory."""

from __future__ import annotations

from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import ResourcesEvent
from agora_client.frontend.lines import human_bytes


class GpuPanel(Widget):
    resources: reactive[ResourcesEvent | None] = reactive(None, layout=True)
    """The latest resources sample from the runtime."""

    def on_mount(self) -> None:
        self.border_title = "GPU"

    def show(self, event: ResourcesEvent) -> None:
        self.resources = event
        self.border_title = "GPU" if event.gpu else "Memory"

    def render(self) -> str:
        sample = self.resources
        if sample is None:
            return "[$text-muted]no sample yet[/]"
        host = f"host RAM {human_bytes(sample.host_ram_used)} / {human_bytes(sample.host_ram_total)}"
        cpu = f" · CPU {sample.cpu_percent:.0f}%" if sample.cpu_percent is not None else ""
        if sample.gpu is None:
            note = escape(sample.gpu_note or "no GPU: showing worker and host memory")
            return f"[$text-warning]{note}[/]\nworker [b]{human_bytes(sample.process_rss)}[/]\n{host}{cpu}"
        gpu = sample.gpu
        share = f" ({gpu.memory_used / gpu.memory_total:.0%})" if gpu.memory_total else ""
        util = f"{gpu.utilization:.0f}%" if gpu.utilization is not None else "N/A"
        return (
            f"[b]{escape(gpu.name)}[/] [$text-muted]#{gpu.index}[/]\n"
            f"VRAM [b]{human_bytes(gpu.memory_used)}[/] / {human_bytes(gpu.memory_total)}{share} · util [b]{util}[/]\n"
            f"[$text-muted]worker {human_bytes(sample.process_rss)} · {host}[/]"
        )
