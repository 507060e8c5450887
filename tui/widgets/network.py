"""Bandwidth: what this node uploads and downloads per second (requests and SPARTA rounds), over time, and the
contributor's upload cap (--max-upload-mbit) where there is one."""

from __future__ import annotations

from agora_client.events import TrafficEvent
from agora_client.frontend.lines import human_bytes, mbit_text
from tui.widgets.chart import Series
from tui.widgets.chart_panel import ChartPanel
from tui.widgets.format import rate_text


def rate_units(top: float) -> tuple[float, str]:
    """The unit a bytes/s chart reads best in, from its largest value."""
    for divisor, unit in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s")):
        if top >= divisor:
            return divisor, unit
    return 1.0, "B/s"


class NetworkPanel(ChartPanel):
    TITLE = "Bandwidth"
    EMPTY = "no traffic yet"
    Y_LABEL = "B/s"
    SERIES = {"up": Series("up", "primary"), "down": Series("down", "accent")}
    UNITS = staticmethod(rate_units)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.traffic: TrafficEvent | None = None

    def show(self, event: TrafficEvent) -> None:
        self.traffic = event
        self.push("up", event.ts, event.upload_bps)
        self.push("down", event.ts, event.download_bps)
        cap = "" if event.upload_cap_bps is None else f" · upload cap {mbit_text(event.upload_cap_bps)}"
        self.describe(
            f"{self.key('up', '↑ ' + rate_text(event.upload_bps))} · "
            f"{self.key('down', '↓ ' + rate_text(event.download_bps))}\n"
            f"[$text-muted]sent {human_bytes(event.bytes_sent)} · received {human_bytes(event.bytes_received)}{cap}[/]"
        )
        self.draw()
