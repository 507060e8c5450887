"""A panel of a few lines of figures (the current values) above a chart of their history, with axes."""

from __future__ import annotations

from datetime import tzinfo
from typing import Iterable

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from tui.widgets.chart import Chart, Point, Series, Units


class ChartPanel(Vertical):
    """``SERIES`` names each line of the chart (its legend label and theme colour); ``push`` adds a point,
    ``plot`` replaces a series, ``draw`` shows the result. The chart shows once a series has two points."""

    TITLE = ""
    EMPTY = ""
    Y_LABEL = ""
    SERIES: dict[str, Series] = {}
    ZERO_BASED = True  # amounts start the y axis at 0; a loss is drawn around its values
    UNITS: Units | None = None

    def __init__(self, tz: tzinfo | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.tz = tz

    def compose(self) -> ComposeResult:
        yield Static(f"[$text-muted]{self.EMPTY}[/]", classes="detail")
        chart = Chart(self.SERIES, self.Y_LABEL, zero_based=self.ZERO_BASED, units=self.UNITS, tz=self.tz)
        chart.display = False  # an empty chart would read as a flat line of zeros
        yield chart

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    @property
    def chart(self) -> Chart:
        return self.query_one(Chart)

    def describe(self, markup: str) -> None:
        self.query_one(".detail", Static).update(markup)

    def key(self, name: str, value: str) -> str:
        """``value`` in its series' colour, labelled: the chart's legend and its current value in one."""
        series = self.SERIES[name]
        return f"[${series.color}]━[/] {series.label} [b]{value}[/]"

    def push(self, name: str, ts: float, value: float) -> None:
        self.chart.push(name, ts, value)

    def plot(self, name: str, points: Iterable[Point]) -> None:
        self.chart.replace(name, points)

    def draw(self) -> None:
        chart = self.chart
        chart.display = chart.has_data
        if chart.has_data:
            chart.redraw()
