"""Bandwidth: what this node uploads and downloads per second (requests and SPARTA rounds)."""

from __future__ import annotations

from agora_client.events import TrafficEvent
from agora_client.frontend.lines import human_bytes
from tui.widgets.chart_panel import ChartPanel
from tui.widgets.format import rate_text


class NetworkPanel(ChartPanel):
    TITLE = "Bandwidth"
    EMPTY = "no traffic yet"
    CHARTS = {"up": "up", "down": "down"}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.traffic: TrafficEvent | None = None

    def show(self, event: TrafficEvent) -> None:
        self.traffic = event
        self.push("up", event.upload_bps)
        self.push("down", event.download_bps)
        self.describe(
            f"↑ [b]{rate_text(event.upload_bps)}[/] · ↓ [b]{rate_text(event.download_bps)}[/]\n"
            f"[$text-muted]sent {human_bytes(event.bytes_sent)} · received {human_bytes(event.bytes_received)}[/]"
        )
