"""Prometheus metrics for operators: every role serves the series of its own state (``prometheus_client``).

A role names its series (``Series``) and reads them from the state it already keeps at scrape time
(``SeriesCollector``), into a registry of its own process (``new_registry``). The HTTP services (auth, monitor,
snapshots) answer ``GET /metrics`` on their own front (``metrics_reply``); the other roles serve it on
``--metrics-port`` (``MetricsEndpoint``). ``deploy/grafana/agora-dashboard.json`` charts these series.
The HTTP front's names are imported on first use: a worker or trainer does not load aiohttp for them.
"""

from importlib import import_module
from typing import Any

from .endpoint import MetricsEndpoint, MetricsUnavailable, add_metrics_arguments, open_metrics_endpoint
from .registry import new_registry
from .series import Series, SeriesCollector, Values

_LAZY = {
    name: "agora_client.operator_metrics.http_front"
    for name in ("METRICS_PATH", "http_front_collector", "metrics_reply")
}

__all__ = [
    "MetricsEndpoint",
    "MetricsUnavailable",
    "Series",
    "SeriesCollector",
    "Values",
    "add_metrics_arguments",
    "new_registry",
    "open_metrics_endpoint",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agora_client.operator_metrics' has no attribute {name!r}")
