"""GPU name, memory and utilization; without an NVIDIA driver, the worker's and host's memory."""

from __future__ import annotations

from textual.markup import escape
from textual.reactive import reactive
from textual.widget import Widget

from agora_client.events import ResourcesEvent, YieldEvent
from agora_client.frontend.lines import human_bytes, human_duration


class GpuPanel(Widget):
    resources: reactive[ResourcesEvent | None] = reactive(None, layout=True)
    """The latest resources sample from the runtime."""
    yielding: reactive[YieldEvent | None] = reactive(None, layout=True)
    """Why the worker yields the GPU to its owner; None while it serves."""

    def on_mount(self) -> None:
        self.border_title = "GPU"

    def show(self, event: ResourcesEvent) -> None:
        self.resources = event
        self.border_title = "GPU" if event.gpu else "Memory"

    def show_yield(self, event: YieldEvent) -> None:
        self.yielding = None if event.state == "resumed" else event

    def _yield_line(self) -> str:
        """In place of the memory line while yielding: that the worker yields, why, and how long the slot is kept."""
        event = self.yielding
        if event.state == "left":
            return f"[$text-warning b]gave its slot back[/] [$text-warning]{escape(event.reason)}[/]"
        kept = f" · slot kept {human_duration(event.grace_left_s)}" if event.grace_left_s is not None else ""
        return f"[$text-warning b]yielding[/] [$text-warning]{escape(event.reason)}{kept}[/]"

    def render(self) -> str:
        sample = self.resources
        if sample is None:
            return self._yield_line() if self.yielding else "[$text-muted]no sample yet[/]"
        host = f"host RAM {human_bytes(sample.host_ram_used)} / {human_bytes(sample.host_ram_total)}"
        cpu = f" · CPU {sample.cpu_percent:.0f}%" if sample.cpu_percent is not None else ""
        if sample.gpu is None:
            note = escape(sample.gpu_note or "no GPU: showing worker and host memory")
            last = self._yield_line() if self.yielding else f"{host}{cpu}"
            return f"[$text-warning]{note}[/]\nworker [b]{human_bytes(sample.process_rss)}[/]\n{last}"
        gpu = sample.gpu
        share = f" ({gpu.memory_used / gpu.memory_total:.0%})" if gpu.memory_total else ""
        util = f"{gpu.utilization:.0f}%" if gpu.utilization is not None else "N/A"
        return (
            f"[b]{escape(gpu.name)}[/] [$text-muted]#{gpu.index}[/]\n"
            f"VRAM [b]{human_bytes(gpu.memory_used)}[/] / {human_bytes(gpu.memory_total)}{share} · util [b]{util}[/]\n"
            + (
                self._yield_line()
                if self.yielding
                else f"[$text-muted]worker {human_bytes(sample.process_rss)} · {host}[/]"
            )
        )
