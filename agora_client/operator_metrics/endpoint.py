"""``--metrics-port``: ``GET /metrics`` for a role without an HTTP server of its own (worker, trainer, seed, relay),
served by ``prometheus_client``'s own server in a background thread."""

from __future__ import annotations

import argparse

from prometheus_client import start_http_server
from prometheus_client.registry import Collector

from .registry import new_registry


class MetricsUnavailable(ValueError):
    """The metrics port cannot be listened on; the message says what to do."""


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port at /metrics (default: off; 0: any free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port listens on (default: loopback; the scraper's host must reach it)",
    )


class MetricsEndpoint:
    """The role's registry, served on ``host``:``port`` (``port`` None: kept, not served); listening on construction.

    Collectors may be added once the state they read exists: until then a scrape gets the process's series only.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None):
        self.registry = new_registry()
        self._server = None
        if port is None:
            return
        try:
            self._server, _ = start_http_server(port, host, self.registry)
        except (OSError, ValueError) as error:
            raise MetricsUnavailable(
                f"cannot serve metrics on {host}:{port} ({error}); pick another --metrics-port or --metrics-host"
            ) from None

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics``; None when not served."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"

    def add(self, collector: Collector) -> None:
        self.registry.register(collector)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "MetricsEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_metrics_endpoint(args: argparse.Namespace, role: str) -> MetricsEndpoint:
    """The endpoint ``--metrics-port`` asks for, listening already (so a taken port fails before the role starts),
    its address said on stdout; MetricsUnavailable says what to do."""
    endpoint = MetricsEndpoint(args.metrics_host, args.metrics_port)
    if endpoint.url is not None:
        print(f"[METRICS] the {role}'s Prometheus metrics at {endpoint.url}", flush=True)
    return endpoint
