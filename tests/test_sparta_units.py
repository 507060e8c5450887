"""SPARTA slices, reports and input checks; one real loopback DHT for the averager's own checks."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest
import torch

from agora_client.averaging.partition import StridedPartition, due_round, partition_of
from agora_client.averaging.sparta import RoundReport, SpartaAverager
from agora_client.config import SpartaConfig
from agora_client.discovery.roster import WorkerRecord, announce, averaging_workers, fetch_roster
from agora_client.events import SpartaEvent, dump_event, parse_event
from agora_client.frontend.lines import LineFormatter
from tests.swarm_helpers import wait_until

SIZES = [7, 0, 1, 13, 4, 29]  # includes an empty tensor and tensors smaller than the stride


@pytest.mark.parametrize("partitions", [1, 3, 4, 20, 60])
def test_slices_cover_every_element_exactly_once(partitions: int) -> None:
    partition = StridedPartition(SIZES, partitions)
    total = sum(SIZES)
    owner = torch.full((total,), -1)
    starts = torch.tensor([0, *SIZES]).cumsum(0)
    for part in range(partitions):
        assert sum(segment.count for segment in partition.segments(part)) == partition.slice_size(part)
        for segment in partition.segments(part):
            flat = starts[segment.tensor_index] + segment.start + torch.arange(segment.count) * partitions
            assert bool((owner[flat] == -1).all()), "an element belongs to two slices"
            owner[flat] = part
    assert torch.equal(owner, torch.arange(total) % partitions)
    sizes = [partition.slice_size(part) for part in range(partitions)]
    assert max(sizes) - min(sizes) <= 1 and partition.max_slice_size == max(sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gather_and_add_follow_the_flat_vector_in_any_dtype(dtype: torch.dtype) -> None:
    # values below 256 so that bf16 holds them and their +1 exactly
    tensors = [torch.arange(size, dtype=dtype).reshape(size, 1) + 10 * index for index, size in enumerate(SIZES)]
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors]).float()
    partition = StridedPartition.of(tensors, 4)
    for part in range(4):
        mask = torch.arange(flat.numel()) % 4 == part
        out = torch.zeros(partition.max_slice_size)
        partition.gather(tensors, part, out)
        assert torch.equal(out[: partition.slice_size(part)], flat[mask])
        before = [tensor.clone() for tensor in tensors]
        partition.add_(tensors, part, torch.ones(partition.slice_size(part)))
        moved = torch.cat([(after - old).reshape(-1) for after, old in zip(tensors, before, strict=True)]).float()
        assert torch.equal(moved, mask.float())


def test_fingerprint_separates_layouts_and_fractions() -> None:
    assert StridedPartition(SIZES, 4).fingerprint == StridedPartition(list(SIZES), 4).fingerprint
    assert StridedPartition(SIZES, 4).fingerprint != StridedPartition(SIZES, 5).fingerprint
    assert StridedPartition(SIZES, 4).fingerprint != StridedPartition([*SIZES[:-1], 30], 4).fingerprint


def test_rounds_rotate_with_the_stage_epoch() -> None:
    assert [due_round(epoch, 20) for epoch in (0, 1, 19, 20, 39, 40)] == [None, None, None, 1, None, 2]
    # a worker whose epoch jumps over a round's first epoch still starts that round, once
    assert [due_round(epoch, 2, since) for since, epoch in ((3, 5), (4, 5), (0, 3), (0, 1), (10, 100), (5, 6))] == [
        2,
        None,
        1,
        None,
        50,
        3,
    ]
    assert [partition_of(round_no, 20) for round_no in (0, 1, 19, 20, 41)] == [0, 1, 19, 0, 1]


def test_non_contiguous_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        StridedPartition.of([torch.zeros(4, 5).t()], 4)


def test_round_report_becomes_a_sparta_event() -> None:
    report = RoundReport(3, 3, 2, 0.5, 100, 90, 1.5, 0.0, ok=True, reason="50 of 100 elements kept their local values")
    event = report.to_event(StridedPartition([60, 40], 20))  # a stage of 100 parameters in 20 slices of 5
    assert isinstance(event, SpartaEvent)
    assert parse_event(dump_event(event)).model_dump(exclude={"ts"}) == event.model_dump(exclude={"ts"})
    assert (event.round, event.fraction, event.bytes_received, event.weight, event.reason) == (
        3,
        0.5,
        90,
        0.0,
        report.reason,
    )
    assert (event.partition, event.partitions, event.stage_share) == (3, 20, 0.05)


@pytest.fixture(scope="module")
def dht() -> Iterator[object]:
    from hivemind import DHT

    node = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        yield node
    finally:
        node.shutdown()


def test_bad_input_is_refused_with_one_clear_error(dht: object) -> None:
    parameters = [torch.nn.Parameter(torch.randn(40))]
    config = SpartaConfig(fraction=0.25, matchmaking_time=1.0)
    with pytest.raises(ValueError, match="without '.'"):
        SpartaAverager(dht, "stage.body1", parameters, config, lock=threading.Lock())
    sparta = SpartaAverager(dht, "units_bad_input", parameters, config, lock=threading.Lock())
    try:
        for weight in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="finite number >= 0"):
                sparta.begin_round(1, weight)
        with pytest.raises(ValueError, match="round number"):
            sparta.begin_round(-1, 1.0)
        assert not sparta.in_flight
    finally:
        sparta.shutdown()


def test_a_lone_worker_reports_a_failed_round_and_keeps_its_weights(dht: object) -> None:
    parameters = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(3, 3))]
    before = [parameter.detach().clone() for parameter in parameters]
    seen: list[RoundReport] = []
    config = SpartaConfig(fraction=0.25, matchmaking_time=1.0)
    sparta = SpartaAverager(dht, "units_lone", parameters, config, lock=threading.Lock(), on_round=seen.append)
    try:
        first = sparta.begin_round(5, 1.0)
        second = sparta.begin_round(6, 1.0)  # the first is still looking for a group: it gives way
        superseded = first.result(timeout=60)
        assert not superseded.ok and superseded.group_size == 0 and "gave way to round 6" in superseded.reason
        report = second.result(timeout=60)
        assert not report.ok and report.group_size == 0 and report.fraction == 0.0 and report.partition == 2
        assert "no other worker" in report.reason
        assert seen == [superseded, report], "one report, hence one event, per failed round"
        assert all(torch.equal(parameter, old) for parameter, old in zip(parameters, before, strict=True))
        for failed in seen:  # what the app and headless show of each: one warning line with its reason
            (line,) = LineFormatter().format(parse_event(dump_event(failed.to_event(sparta.partition))))
            assert (line.tag, line.level) == ("SPARTA", "warning") and failed.reason in line.text, line
            assert "Traceback" not in line.text
    finally:
        sparta.shutdown()


def test_a_round_that_waited_behind_the_one_before_gives_way_once_its_peers_moved_on(dht: object) -> None:
    """A worker one round behind its stage (a joiner whose first round was already past) runs each round after the
    one before fails: the time a round waited counts toward the time a group needs, or every next round would
    wait behind it, start its search after its peers had averaged, and fail the same way."""
    parameters = [torch.nn.Parameter(torch.randn(40))]
    config = SpartaConfig(fraction=0.25, matchmaking_time=2.0)  # a group needs 2 + 4 s; a search gives up after 6
    sparta = SpartaAverager(dht, "units_behind", parameters, config, lock=threading.Lock())
    needs = config.matchmaking_time + 2 * config.matchmaking_time

    def searching(round_no: int) -> bool:
        flight = sparta._flight
        return flight.round_no == round_no and flight.control is not None and not flight.control.done()

    try:
        first = sparta.begin_round(5, 1.0)
        wait_until(lambda: searching(5), 60, "round 5's search", poll=0.05)
        second = sparta.begin_round(6, 1.0)  # round 5 searches, young: round 6 waits behind it
        begun = time.monotonic()
        wait_until(lambda: searching(6), 60, "round 6's search, after round 5's", poll=0.05)
        assert "no other worker" in first.result(timeout=60).reason
        # round 6 has searched for a moment only (it gives up 6 s after it began searching), but was begun
        # longer ago than a group needs
        wait_until(
            lambda: time.monotonic() - begun > needs, 60, "the time a group needs since round 6 was begun", poll=0.05
        )
        assert searching(6), "round 6 ended its search before round 7 was due: this machine is too slow for the test"
        third = sparta.begin_round(7, 1.0)
        assert "gave way to round 7" in second.result(timeout=60).reason
        assert "no other worker" in third.result(timeout=60).reason
    finally:
        sparta.shutdown()


def test_a_round_waits_for_every_worker_of_the_roster_but_those_yielding(dht: object) -> None:
    """The group's target size is the roster's, not the progress tracker's peer count, which leaves out a worker
    with no samples in the last epochs (slow, relayed or syncing) so that its peers closed every group without it."""
    workers = [
        WorkerRecord(uid="body1.0.0", peer_id="active", stage="body1"),
        WorkerRecord(uid="body1.0.1", peer_id="syncing", stage="body1", sync_phase=1),  # averages receive-only
        WorkerRecord(uid="body1.0.2", peer_id="warming", stage="body1", sync_phase=2),
        WorkerRecord(uid="body1.0.3", peer_id="yielding", stage="body1", yielding=True),  # begins no round
        WorkerRecord(uid="body2.0.0", peer_id="other stage", stage="body2"),
    ]
    for record in workers:
        assert announce(dht, record, ttl=60)
    assert averaging_workers(fetch_roster(dht, "body1")) == 3
    assert averaging_workers({}) == 0  # no roster yet: the round assembles at its deadline


def test_hivemind_round_failures_do_not_reach_the_log_as_tracebacks() -> None:
    import logging
    from concurrent.futures import InvalidStateError

    from hivemind.averaging.partition import AllreduceException

    from agora_client.engine.averaging import _not_cancel_noise, _reported_by_the_round

    def record(message: str, error: BaseException | None = None, level: int = logging.ERROR) -> logging.LogRecord:
        exc_info = (type(error), error, None) if error is not None else None
        return logging.LogRecord("hivemind.averaging.averager", level, __file__, 1, message, None, exc_info)

    # the round reports these itself, as one SpartaEvent with its reason
    assert not _reported_by_the_round(record("Averaging step failed", AllreduceException("could not find a group")))
    assert not _reported_by_the_round(record("Averaging: received 52.6% results", level=logging.WARNING))
    assert _reported_by_the_round(record("something else entirely", level=logging.WARNING))
    late = InvalidStateError("Can't set_result to a future that is CANCELLED (123)")
    assert not _not_cancel_noise(record("Task exception was never retrieved", late))
    assert not _not_cancel_noise(record("Task was destroyed but it is pending!\ntask: <Task cancelling ...>"))
    assert _not_cancel_noise(record("Task exception was never retrieved", RuntimeError("a real bug")))


def test_a_step_called_off_then_stopped_is_cancelled_once_without_an_error() -> None:
    """A round called off (it gave way to a later one) and then the averager stopped both cancel hivemind's step:
    hivemind's cancel() raises InvalidStateError the second time, which once crashed a worker's stop."""
    from concurrent.futures import InvalidStateError

    from hivemind.averaging.control import StepControl
    from hivemind.utils import MPFuture, get_dht_time

    from agora_client.averaging.sparta import cancel_step

    trigger, cancel = MPFuture(), MPFuture()  # a plain MPFuture first: it starts the process's backend for its class
    control = StepControl(get_dht_time() + 60, float("inf"), False, 1.0, b"")
    control.attach(trigger=trigger, cancel=cancel)
    cancel_step(control)
    assert control.cancelled()
    with pytest.raises(InvalidStateError):
        control.cancel()  # upstream's own, once more
    cancel_step(control)
    assert control.cancelled()
