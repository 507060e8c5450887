"""A panel of a few lines of figures above one or more sparklines of their recent history."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

HISTORY = 120  # points kept per chart: two hours of 1-minute figures, or four minutes of 2-second ones


class ChartPanel(Vertical):
    """``CHARTS`` maps each series to its label (empty: a lone chart needs none); ``push`` adds a value,
    ``plot`` replaces a series. A chart shows once its series has two values to compare."""

    TITLE = ""
    EMPTY = ""
    CHARTS: dict[str, str] = {"chart": ""}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.series: dict[str, deque[float]] = {name: deque(maxlen=HISTORY) for name in self.CHARTS}

    def compose(self) -> ComposeResult:
        yield Static(f"[$text-muted]{self.EMPTY}[/]", classes="detail")
        for name, label in self.CHARTS.items():
            with Horizontal(classes=f"chart-row row-{name}") as row:
                row.display = False  # an empty chart would read as a flat line of zeros
                if label:
                    yield Label(label, classes="chart-label")
                yield Sparkline([], classes=f"chart chart-{name}")

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def describe(self, markup: str) -> None:
        self.query_one(".detail", Static).update(markup)

    def push(self, name: str, value: float) -> None:
        self.series[name].append(value)
        self._draw(name)

    def plot(self, name: str, values: Iterable[float]) -> None:
        self.series[name].clear()
        self.series[name].extend(values)
        self._draw(name)

    def _draw(self, name: str) -> None:
        self.query_one(f".chart-{name}", Sparkline).data = list(self.series[name])
        self.query_one(f".row-{name}").display = len(self.series[name]) >= 2
