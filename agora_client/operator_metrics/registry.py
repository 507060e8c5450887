"""The registry of one role's process: its series and the process's own (CPU, memory, open files)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.registry import Collector


def new_registry(*collectors: Collector) -> CollectorRegistry:
    """Not prometheus_client's global registry: tests run several roles in one process, each with its own."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    for collector in collectors:
        registry.register(collector)
    return registry
