"""A line chart of named series against wall time, with labelled axes (textual-plotext's PlotextPlot).

Series are lists of (unix time, value). The x axis reads as clock time at round seconds, minutes or hours;
the y axis carries round values and the series' unit. plotext is pure Python: the app's process stays
free of numpy (tests/test_frontend.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Callable, Iterable

from textual import events
from textual.color import Color
from textual_plotext import PlotextPlot

HISTORY = 120  # points kept per series: two hours of 1-minute figures, or four minutes of 2-second ones
Point = tuple[float, float]  # (unix time, value)
# y units: the chart's largest value -> (divisor, axis label), e.g. bytes/s in MB/s
Units = Callable[[float], tuple[float, str]]
_CLOCK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 604800)
TICK_COLUMNS = 8  # room for one x tick label and the space between two
Y_MARGIN = 7  # columns plotext gives the y tick labels and the axis
X_LABEL = "time"


@dataclass(frozen=True)
class Series:
    label: str
    color: str  # a theme colour's name (primary, accent, warning, success, error, secondary)


def clock_ticks(low: float, high: float, columns: int, tz: tzinfo | None) -> tuple[list[float], list[str]]:
    """Ticks at round seconds, minutes or hours of the clock, as many as ``columns`` leave room for, labelled
    HH:MM (HH:MM:SS below a minute apart)."""
    fit = max(2, columns // TICK_COLUMNS)
    step = next((step for step in _CLOCK_STEPS if (high - low) / step <= fit), _CLOCK_STEPS[-1])
    form = "%H:%M:%S" if step < 60 else "%H:%M" if step < 86400 else "%m-%d"
    first = math.ceil(low / step) * step
    ticks = [first + step * index for index in range(int((high - first) // step) + 1)]
    return ticks, [datetime.fromtimestamp(tick, tz).strftime(form) for tick in ticks]


def value_ticks(low: float, high: float, rows: int) -> tuple[list[float], list[str]]:
    """Round values (1, 2 or 5 times a power of ten apart), about one every other row and at least two;
    k / M past 10,000. Never two to a row: plotext writes ticks that round to one row over each other, in an order
    that varies from one process to the next."""
    span, wanted = high - low, max(1, rows // 2)
    power = math.floor(math.log10(span))
    steps = sorted(multiple * 10.0**exponent for exponent in range(power - 2, power + 1) for multiple in (1, 2, 5))
    spaced = [step for step in steps if span / step <= wanted + 1 and len(_ticks(low, high, step)) >= 2]
    step = spaced[0] if spaced else next(step for step in reversed(steps) if len(_ticks(low, high, step)) >= 2)
    ticks, top = _ticks(low, high, step), max(abs(low), abs(high))
    while len(ticks) > 2 and (ticks[1] - ticks[0]) / span * max(1, rows - 1) < 1.5:  # at least 1.5 rows apart
        ticks = ticks[::2]
    divisor, suffix = (1e6, "M") if top >= 1e6 else (1e3, "k") if top >= 1e4 else (1, "")
    decimals = max(0, -math.floor(math.log10(step / divisor) + 1e-9))
    return ticks, [f"{tick / divisor:.{decimals}f}{suffix}" if tick else "0" for tick in ticks]


def _ticks(low: float, high: float, step: float) -> list[float]:
    first = math.ceil(low / step)
    return [index * step for index in range(first, math.floor(high / step) + 1)]


def y_range(values: Iterable[float], zero_based: bool) -> tuple[float, float]:
    """The y limits: from 0 for amounts, around the values with a margin for a loss; never a zero-height range."""
    values = list(values)
    low, high = min(values), max(values)
    if zero_based:
        low = min(low, 0.0)
    pad = (high - low) * 0.05 or max(abs(high) * 0.05, 0.5)
    return (low if zero_based and low == 0 else low - pad), high + pad


class Chart(PlotextPlot):
    def __init__(
        self,
        series: dict[str, Series],
        y_label: str,
        *,
        zero_based: bool = True,
        units: Units | None = None,
        tz: tzinfo | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.spec, self.y_label, self.zero_based, self.units, self.tz = series, y_label, zero_based, units, tz
        self.series: dict[str, deque[Point]] = {name: deque(maxlen=HISTORY) for name in series}

    @property
    def has_data(self) -> bool:
        """Some series has two points to draw a line between."""
        return any(len(points) >= 2 for points in self.series.values())

    def push(self, name: str, ts: float, value: float) -> None:
        self.series[name].append((ts, value))

    def replace(self, name: str, points: Iterable[Point]) -> None:
        self.series[name].clear()
        self.series[name].extend(points)

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda theme: self.redraw())  # lines in the new theme's colours

    def on_resize(self, event: events.Resize) -> None:
        self.redraw()  # as many ticks as the new size has room for

    def redraw(self) -> None:
        """Draw every series again, with ticks for the chart's size."""
        plt = self.plt
        plt.clear_figure()
        drawn = {name: points for name, points in self.series.items() if points}
        if not drawn or not self.size.width:
            self.refresh()
            return
        top = max(abs(value) for points in drawn.values() for _, value in points)
        divisor, label = self.units(top) if self.units is not None else (1.0, self.y_label)
        colors = self.app.get_css_variables()
        for name, points in drawn.items():
            color = Color.parse(colors.get(self.spec[name].color, "white")).rgb
            plt.plot([ts for ts, _ in points], [value / divisor for _, value in points], marker="braille", color=color)
        low, high = y_range((value / divisor for points in drawn.values() for _, value in points), self.zero_based)
        times = [ts for points in drawn.values() for ts, _ in points]
        first, last = min(times), max(times)
        if last - first < 1:  # points of one moment: a minute around it, not a microsecond
            first, last = first - 30, last + 30
        plt.xlim(first, last)
        plt.ylim(low, high)
        plt.xticks(*clock_ticks(first, last, self.size.width - Y_MARGIN, self.tz))
        plt.yticks(*value_ticks(low, high, self.size.height - 3))
        plt.xlabel(X_LABEL)
        plt.ylabel(label)
        self.refresh()
