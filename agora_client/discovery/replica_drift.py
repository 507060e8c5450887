"""A stage's replica drift: how far its workers' copies of the parameters are apart, as its workers measured it.

Each worker's signed metrics record carries ``sparta_drift_before`` of its latest SPARTA round that averaged: the
relative L2 of the slice it sent from its group's average (agora_client/averaging/drift.py). The stage's figure is
the mean of that over its workers' records that have one. The app's swarm view and the trainer's spot-check
report both take it from here, from the records as ``agora_client.monitor.records.fetch_metrics`` verifies them.
"""

from __future__ import annotations

from collections.abc import Iterable

from agora_client.discovery.signed_records import MetricsRecord


def replica_drift(records: Iterable[MetricsRecord]) -> float | None:
    """The mean ``sparta_drift_before`` of the records that have one; None when no worker has averaged yet."""
    drifts = [record.sparta_drift_before for record in records if record.sparta_drift_before is not None]
    return sum(drifts) / len(drifts) if drifts else None
