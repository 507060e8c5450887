"""The replica drift figure: its arithmetic, and how it travels (round report, event, line, metrics record, DHT schema).
That it equals the distance computed from real workers' stage tensors is tested in test_sparta.py."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.dht.protocol import DHTProtocol

from agora_client.averaging.drift import relative_l2
from agora_client.averaging.partition import StridedPartition
from agora_client.averaging.sparta import RoundReport
from agora_client.config import load_config
from agora_client.discovery.signed_records import MetricsRecord, metrics_key
from agora_client.discovery.validators import swarm_key_schemas
from agora_client.events import SpartaEvent, dump_event, parse_event
from agora_client.frontend.lines import LineFormatter
from agora_client.worker.metrics import WorkerMetrics


def test_relative_l2_is_the_distance_over_the_reference_norm() -> None:
    reference = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_l2(torch.tensor([3.0, 4.0]), reference) == 0.0
    assert relative_l2(torch.tensor([0.0, 4.0]), reference) == pytest.approx(3 / 5)
    assert relative_l2(torch.tensor([3.0, 4.0], dtype=torch.bfloat16), reference.double()) == 0.0
    # two equal-weight replicas: each is ||x1 - x2|| / ||x1 + x2|| from their average
    first, second = torch.randn(1000), torch.randn(1000)
    expected = float((first - second).norm() / (first + second).norm())
    assert relative_l2(first, (first + second) / 2) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("reference", [[0.0, 0.0], [math.inf, 1.0], [math.nan, 1.0]])
def test_relative_l2_of_a_zero_or_broken_reference_is_not_a_number_to_report(reference: list[float]) -> None:
    assert relative_l2(torch.tensor([1.0, 2.0]), torch.tensor(reference)) is None


def test_a_non_finite_local_slice_has_no_drift() -> None:
    assert relative_l2(torch.tensor([math.nan, 2.0]), torch.tensor([1.0, 2.0])) is None


def test_the_round_report_carries_drift_into_the_event_and_the_sparta_line() -> None:
    report = RoundReport(3, 3, 2, 1.0, 100, 90, 1.5, 1.0, ok=True, drift_before=0.0312, drift_after=0.0)
    event = parse_event(dump_event(report.to_event(StridedPartition([60, 40], 20))))
    assert isinstance(event, SpartaEvent) and (event.drift_before, event.drift_after) == (0.0312, 0.0)
    (line,) = LineFormatter().format(event)
    assert (
        line.text == "Round 3: averaged partition 3 of 20 (5% of the stage; drift 3.12% -> 0%) in a group of 2 in 1.5s"
    )


def test_an_event_recorded_before_drift_still_parses_and_reads_as_before() -> None:
    recorded = (
        '{"v": 1, "ts": 1.0, "kind": "sparta", "round": 1, "partition": 0, "group_size": 3, "fraction": 1.0, '
        '"partitions": 20, "stage_share": 0.05}'
    )
    event = parse_event(recorded)
    assert isinstance(event, SpartaEvent) and event.drift_before is None and event.drift_after is None
    (line,) = LineFormatter().format(event)
    assert "drift" not in line.text and "(5% of the stage)" in line.text


def _metrics() -> WorkerMetrics:
    metrics = WorkerMetrics(load_config("tiny").model, "body1", peer_id="peer", identity="alice", ticket="ticket")
    metrics.set_phase("active")
    return metrics


def test_the_metrics_record_keeps_the_latest_measured_drift() -> None:
    metrics = _metrics()
    assert (metrics.snapshot().sparta_drift_before, metrics.snapshot().sparta_drift_after) == (None, None)
    metrics.on_sparta_round(True, 1.0, 0.25, 0.001)
    metrics.on_sparta_round(False, 0.0)  # a failed round measures nothing: the last figures stay
    record = metrics.snapshot()
    assert (record.sparta_rounds, record.sparta_drift_before, record.sparta_drift_after) == (2, 0.25, 0.001)


def test_the_dht_schema_accepts_records_with_and_without_drift() -> None:
    """What every node checks before storing a worker's metrics.

    The published JSON, after msgpack, validated strictly."""
    schema = swarm_key_schemas(["body1"])[metrics_key("body1")].model
    metrics = _metrics()
    old = metrics.snapshot().model_dump(mode="json")
    del old["sparta_drift_before"], old["sparta_drift_after"]  # a worker from before drift publishes neither field
    metrics.on_sparta_round(True, 1.0, 0.25, 0.0)
    for published in (old, metrics.snapshot().model_dump(mode="json")):
        stored = DHTProtocol.serializer.loads(DHTProtocol.serializer.dumps(published))
        assert schema.model_validate(stored, strict=True) == MetricsRecord.model_validate(published)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        schema.model_validate({**old, "sparta_drift_before": -0.5}, strict=True)
