"""``GET /metrics`` on a service of the guarded HTTP front (auth, monitor, snapshots), and the front's own series."""

from __future__ import annotations

from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from agora_client.http_service import HttpService, Reply

from .series import Series, SeriesCollector

METRICS_PATH = "/metrics"
OPEN_CONNECTIONS = Series(
    "agora_http_open_connections", "gauge", "connections open on the service's HTTP front", ("service",)
)


def metrics_reply(registry: CollectorRegistry) -> Reply:
    return Reply(HTTPStatus.OK, generate_latest(registry), {"Content-Type": CONTENT_TYPE_LATEST})


def http_front_collector(service: HttpService) -> SeriesCollector:
    """The front's open connections (what its connection caps count)."""
    return SeriesCollector(
        [OPEN_CONNECTIONS], lambda: {OPEN_CONNECTIONS.name: {service.name: service.open_connections}}
    )
