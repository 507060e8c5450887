"""A series an Agora role exports, and a collector that reads a role's state into its series at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

Values = float | Mapping[str | tuple[str, ...], float]
"""A series' value now: one number for a series without labels, else label value(s) -> number."""


@dataclass(frozen=True)
class Series:
    name: str
    """Without ``_total``: the exposition adds it to a counter's samples (``exposed_name``)."""
    kind: Literal["counter", "gauge"]
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exposed_name(self) -> str:
        """The name a query (and the Grafana dashboard) uses."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    def family(self, values: Values | None = None) -> Metric:
        """The metric family holding ``values`` (none: an empty family, what ``describe`` hands the registry)."""
        kind = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        family = kind(self.name, self.help, labels=self.labels)
        if values is None:
            return family
        if not self.labels:
            family.add_metric((), float(values))
            return family
        for key, value in values.items():
            family.add_metric((key,) if isinstance(key, str) else key, float(value))
        return family


class SeriesCollector:
    """A ``prometheus_client`` collector of ``series``, read from ``read()`` at every scrape: it returns each
    series' values by name; a series it leaves out has no sample this time (e.g. before the state exists)."""

    def __init__(self, series: Sequence[Series], read: Callable[[], Mapping[str, Values]]):
        self.series, self._read = tuple(series), read

    def describe(self) -> Iterator[Metric]:
        return (series.family() for series in self.series)

    def collect(self) -> Iterator[Metric]:
        values = self._read()
        for series in self.series:
            if series.name in values:
                yield series.family(values[series.name])
