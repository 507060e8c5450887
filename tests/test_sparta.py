"""SPARTA averaging between real hivemind peers, each in its own process with its own DHT (loopback only)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import Future
from contextlib import suppress
from itertools import pairwise
from multiprocessing.connection import Connection
from typing import Any, Iterator

import pytest
import torch

from agora_client.auth.ticket_source import SelfIssuedTickets
from agora_client.auth.tickets import generate_signing_key, load_signing_key, public_key_text, save_signing_key
from agora_client.averaging.bounds import FLOOR_RMS
from agora_client.averaging.compression import SlicePayload
from agora_client.averaging.group_admission import GroupAdmission
from agora_client.averaging.partition import StridedPartition
from agora_client.averaging.sparta import SHUTTING_DOWN, RoundReport, SpartaAverager
from agora_client.config import SpartaConfig
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.ticket_gate import TicketGate

pytestmark = pytest.mark.integration

SHAPES = [(300, 700), (1001,), (7, 11, 13)]  # 212002 elements: slices of ~53k floats, so protobuf headers are noise
CONFIG = SpartaConfig(
    period=1,
    fraction=0.25,
    matchmaking_time=2.0,
    allreduce_timeout=15.0,
    sender_timeout=4.0,  # a loaded 2-core machine once held a healthy peer's part back past 2 s + 2 s
    reducer_timeout=4.0,
    max_peer_delta=4.0,  # these peers differ by up to ~3.2x a part's norm on purpose: the bound must not clip them
)
TIGHT = CONFIG.model_copy(update={"max_peer_delta": 0.5})
PARTITIONS = CONFIG.num_partitions
REPLY_TIMEOUT = 180.0  # bounds a hang, not speed: the machine may be shared and busy


def _initial_values(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * (seed + 1) for shape in SHAPES]


def _flat(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in parameters]).clone()


class _FreezesAfterMatchmaking(SpartaAverager):
    """A peer that joins a group and then never sends its slice, until the test SIGKILLs it."""

    def __init__(self, *args: Any, on_grouped: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_grouped = on_grouped

    def _run_step(self, flight: Any, gather: dict, weight: float) -> dict:
        from hivemind.averaging.control import AveragingStage

        control = self._averager.begin_step(gather=gather, weight=weight, require_trigger=True)
        while control.stage != AveragingStage.AWAITING_TRIGGER:
            time.sleep(0.01)
        self._on_grouped()
        threading.Event().wait()  # the all-reduce is never allowed to start; this process dies here
        raise AssertionError("unreachable")


class _StepsOnlyAfterItsStop(SpartaAverager):
    """A peer whose round reaches hivemind's step only after a stop, begun meanwhile, ended the averager's process."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.at_step = threading.Event()

    def _run_step(self, flight: Any, gather: dict, weight: float) -> Any:
        self.at_step.set()
        deadline = time.monotonic() + REPLY_TIMEOUT
        while self._averager.is_alive():
            assert time.monotonic() < deadline, "the averager's process was never stopped"
            time.sleep(0.05)
        return super()._run_step(flight, gather, weight)


def _wait_for_allreduce(sparta: SpartaAverager) -> None:
    from hivemind.averaging.control import AveragingStage

    deadline = time.monotonic() + REPLY_TIMEOUT
    while (control := sparta._flight.control) is None or control.stage != AveragingStage.RUNNING_ALLREDUCE:
        assert time.monotonic() < deadline, "the round never reached its all-reduce"
        time.sleep(0.05)
    while sparta._averager.traffic_bytes()[0] == 0:  # the runner is registered and sending: the stop must end it
        assert time.monotonic() < deadline, "the all-reduce never sent a part"
        time.sleep(0.05)


def _admission(ticketing: tuple[str, str] | None) -> GroupAdmission | None:
    """Tickets on for this stage ("body1"): signed with the key at path, this peer's own for ticket_stage."""
    if ticketing is None:
        return None
    key_path, ticket_stage = ticketing
    gate = TicketGate(public_key_text(load_signing_key(key_path)), roles=("worker",), stage="body1")
    tickets = SelfIssuedTickets.from_file(key_path, role="worker", stage=ticket_stage)
    return GroupAdmission(gate, tickets, RejectionLog(lambda message: None))


def _peer_main(
    conn: Connection,
    index: int,
    initial_peers: list[str],
    kind: str,
    config: SpartaConfig,
    ticketing: tuple[str, str] | None,
) -> None:
    """One worker of a stage: its own DHT, parameters and SpartaAverager, driven by commands over `conn`."""
    os.setpgrp()  # the test can SIGKILL this peer with its DHT, averager and p2pd processes at once
    from hivemind import DHT

    torch.set_num_threads(1)
    parameters = [torch.nn.Parameter(value) for value in _initial_values(index)]
    lock = threading.Lock()
    dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    conn.send([str(addr) for addr in dht.get_visible_maddrs()])
    admission = _admission(ticketing)
    if admission is not None:
        admission.rejections.start()
    if kind == "freeze":
        sparta: SpartaAverager = _FreezesAfterMatchmaking(
            dht, "test_sparta", parameters, config, lock=lock, on_grouped=lambda: conn.send("grouped")
        )
    elif kind == "stop before step":
        sparta = _StepsOnlyAfterItsStop(dht, "test_sparta", parameters, config, lock=lock)
    else:
        sparta = SpartaAverager(dht, "test_sparta", parameters, config, lock=lock, admission=admission)
    conn.send(("ready", dht.peer_id.to_base58()))
    pending: list[Future[RoundReport]] = []  # rounds begun by "begin", which the test does not wait for
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            if command == "set":
                with lock:
                    for parameter, value in zip(parameters, args[0], strict=True):
                        parameter.data.copy_(value)
                conn.send(_flat(parameters))
            elif command == "round":
                round_no, weight, move = args
                handle = sparta.begin_round(round_no, weight)
                if move:  # training goes on while the round is in flight
                    with lock:
                        for parameter in parameters:
                            parameter.data.add_(move)
                report: RoundReport = handle.result(timeout=REPLY_TIMEOUT)
                conn.send((report, _flat(parameters)))
            elif command == "begin":  # a round the test does not wait for
                pending.append(sparta.begin_round(args[0], 1.0))
                conn.send("begun")
            elif command == "shutdown_mid_allreduce":
                _wait_for_allreduce(sparta)
                pending.append(sparta.begin_round(args[0], 1.0))  # queued behind the all-reduce, which holds the lock
                started = time.monotonic()
                sparta.shutdown()
                conn.send((time.monotonic() - started, [round.result(timeout=REPLY_TIMEOUT) for round in pending]))
            elif command == "shutdown_before_step":
                pending.append(sparta.begin_round(args[0], 1.0))
                assert sparta.at_step.wait(REPLY_TIMEOUT), "the round never reached its step"
                started = time.monotonic()
                sparta.shutdown()
                conn.send((time.monotonic() - started, [round.result(timeout=REPLY_TIMEOUT) for round in pending]))
            elif command == "refusals":
                time.sleep(1.0)  # the rejection log's thread drains its queue every 0.5 s
                conn.send(dict(admission.rejections.counts))
    finally:
        sparta.shutdown()
        dht.shutdown()
        # interpreter teardown can take many seconds on a loaded machine; the test reaps this process group now
        conn.send(("stopped", sparta.in_flight))


class Swarm:
    """Peers of one stage in separate processes; every process group is SIGKILLed on close, even on failure."""

    def __init__(
        self,
        size: int,
        freeze: tuple[int, ...] = (),
        spawn: tuple[int, ...] = (),
        stop_before_step: tuple[int, ...] = (),
        config: SpartaConfig = CONFIG,
        tickets: tuple[str, list[str]] | None = None,
    ):
        """tickets: (signing key path, each peer's ticket stage) to run with averaging tickets on."""
        self.config, self.tickets = config, tickets
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.initial_peers: list[str] = []
        kinds = {**{index: "freeze" for index in freeze}, **{index: "stop before step" for index in stop_before_step}}
        try:
            self._start(size, kinds, spawn)
        except BaseException:
            self.close()  # a peer that did start must not outlive a failed setup
            raise

    def _start(self, size: int, kinds: dict[int, str], spawn: tuple[int, ...]) -> None:
        for index in range(size):
            context = mp.get_context("spawn" if index in spawn else "fork")
            parent, child = context.Pipe()
            process = context.Process(
                target=_peer_main,
                args=(
                    child,
                    index,
                    self.initial_peers,
                    kinds.get(index, "plain"),
                    self.config,
                    None if self.tickets is None else (self.tickets[0], self.tickets[1][index]),
                ),
            )
            process.start()
            self.processes.append(process)
            self.conns.append(parent)
            if index == 0:  # the first peer bootstraps everyone else's DHT
                self.initial_peers = self._recv(0)
        for index in range(1, size):
            self._recv(index)
        self.peer_ids = []
        for index in range(size):
            ready, peer_id = self._recv(index)
            assert ready == "ready"
            self.peer_ids.append(peer_id)

    def _recv(self, index: int, timeout: float = REPLY_TIMEOUT) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conns[index].poll(0.2):
            if not self.processes[index].is_alive():
                raise RuntimeError(f"peer {index} exited with code {self.processes[index].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {index} did not answer within {timeout}s")
        return self.conns[index].recv()

    def set_values(self, values: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        for conn, peer_values in zip(self.conns, values, strict=True):
            conn.send(("set", peer_values))
        return [self._recv(index) for index in range(len(values))]

    def round(
        self,
        peers: list[int],
        round_no: int,
        weights: list[float],
        moves: list[float] | None = None,
        late: tuple[int, ...] = (),
    ):
        """One round on ``peers``; the ``late`` ones start it a second after the others, so they cannot lead it."""
        commands = {
            index: ("round", round_no, weight, move)
            for index, weight, move in zip(peers, weights, moves or [0.0] * len(peers), strict=True)
        }
        for index in (i for i in peers if i not in late):
            self.conns[index].send(commands[index])
        if late:
            time.sleep(1.0)
        for index in (i for i in peers if i in late):
            self.conns[index].send(commands[index])
        return [self._recv(index) for index in peers]

    def refusals(self, index: int) -> dict[str, int]:
        self.conns[index].send(("refusals",))
        return self._recv(index)

    def kill(self, index: int) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.processes[index].pid, signal.SIGKILL)
        if self.processes[index].is_alive():  # killed before it became its own process group
            self.processes[index].kill()

    def close(self) -> list[Any]:
        """Ask every live peer to shut down, then SIGKILL every peer's process group; returns the acks."""
        asked = [index for index, process in enumerate(self.processes) if process.is_alive()]
        for index in asked:
            with suppress(OSError):
                self.conns[index].send(("stop",))
        acks = []
        for index in asked:
            with suppress(Exception):
                acks.append(self._recv(index, timeout=20))
        for index in range(len(self.processes)):
            self.kill(index)  # also reaps a peer's DHT and p2pd daemons if its shutdown left any behind
        for process in self.processes:
            process.join(10)
        return acks


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    swarm = Swarm(3)
    try:
        yield swarm
    finally:
        assert swarm.close() == [("stopped", False)] * 3, "every peer shuts down cleanly"


def _slice_mask(part: int, total: int) -> torch.Tensor:
    return torch.arange(total) % PARTITIONS == part


def _expected_traffic(group_size: int, slice_elements: int) -> float:
    # butterfly: as a sender this peer uploads the (n-1)/n of its slice that others reduce; as a reducer it
    # uploads the averaged 1/n back to each of the n-1 others: 2(n-1)/n x slice x 4 bytes each way
    return 2 * (group_size - 1) / group_size * slice_elements * 4


def test_rounds_converge_and_cover_every_parameter_once(swarm: Swarm) -> None:
    initial = swarm.set_values([_initial_values(seed) for seed in range(3)])
    total = initial[0].numel()
    partition = StridedPartition([torch.Size(shape).numel() for shape in SHAPES], PARTITIONS)
    mean = torch.stack(initial).mean(0)
    previous, spreads, covered = (
        initial,
        [float(torch.stack(initial).std(0).norm())],
        torch.zeros(total, dtype=torch.int64),
    )
    for round_no in range(PARTITIONS):
        results = swarm.round([0, 1, 2], round_no, [1.0, 1.0, 1.0])
        reports = [report for report, _ in results]
        current = [flat for _, flat in results]
        for report in reports:
            assert report.ok and report.reason is None, report
            assert report.group_size == 3 and report.fraction == 1.0 and report.partition == round_no
        # each peer's bytes follow the share it reduces (its probed uplink, after the first rounds); the group's
        # total is the butterfly's whatever the shares: n x 2(n-1)/n x slice each way
        expected = 3 * _expected_traffic(3, partition.slice_size(round_no))
        for moved in (sum(report.bytes_sent for report in reports), sum(report.bytes_received for report in reports)):
            assert abs(moved - expected) <= 0.1 * expected, (reports, expected)
        changed = torch.stack([after != before for after, before in zip(current, previous, strict=True)]).any(0)
        assert torch.equal(changed, _slice_mask(round_no, total)), "a round changed elements outside its slice"
        covered += changed
        for flat in current:
            torch.testing.assert_close(flat[changed], mean[changed])
        spreads.append(float(torch.stack(current).std(0).norm()))
        previous = current
    assert all(later < earlier for earlier, later in pairwise(spreads)), spreads
    assert torch.equal(covered, torch.ones(total, dtype=torch.int64)), "every element is averaged exactly once"
    largest_difference = float((torch.stack(previous).max(0).values - torch.stack(previous).min(0).values).max())
    assert largest_difference < 1e-5


def test_weight_zero_peer_receives_the_others_average(swarm: Swarm) -> None:
    initial = swarm.set_values([_initial_values(seed + 10) for seed in range(3)])
    results = swarm.round([0, 1, 2], 1, [1.0, 1.0, 0.0])
    mask = _slice_mask(1, initial[0].numel())
    pair_mean = (initial[0] + initial[1]) / 2
    for index, (report, flat) in enumerate(results):
        assert report.ok and report.fraction == 1.0 and report.weight == [1.0, 1.0, 0.0][index], report
        torch.testing.assert_close(flat[mask], pair_mean[mask])
        assert torch.equal(flat[~mask], initial[index][~mask])


def test_group_with_all_weights_zero_is_skipped(swarm: Swarm) -> None:
    initial = swarm.set_values([_initial_values(seed + 20) for seed in range(3)])
    results = swarm.round([0, 1, 2], 2, [0.0, 0.0, 0.0])
    for index, (report, flat) in enumerate(results):
        assert not report.ok and report.group_size == 3 and report.fraction == 0.0, report
        assert "weight 0" in (report.reason or "")
        assert torch.equal(flat, initial[index]), "a skipped round must not touch the parameters"


def test_delta_keeps_training_movement_during_the_round(swarm: Swarm) -> None:
    initial = swarm.set_values([_initial_values(seed + 30) for seed in range(3)])
    moves = [0.5, -1.0, 2.0]
    results = swarm.round([0, 1, 2], 3, [1.0, 1.0, 1.0], moves)
    mask = _slice_mask(3, initial[0].numel())
    mean = torch.stack(initial).mean(0)
    for index, (report, flat) in enumerate(results):
        assert report.ok and report.fraction == 1.0, report
        torch.testing.assert_close(flat[mask], mean[mask] + moves[index])
        torch.testing.assert_close(flat[~mask], initial[index][~mask] + moves[index])


def _relative_l2(values: torch.Tensor, reference: torch.Tensor) -> float:
    return float((values.double() - reference.double()).norm() / reference.double().norm())


def test_drift_is_the_distance_of_each_workers_slice_from_the_groups_average(swarm: Swarm) -> None:
    """Workers 0 and 1 average (weights 1, 1); worker 2 only receives (weight 0); worker 1 trains mid-round."""
    initial = swarm.set_values([_initial_values(seed + 40) for seed in range(3)])
    moves = [0.0, 0.25, 0.0]
    results = swarm.round([0, 1, 2], 2, [1.0, 1.0, 0.0], moves)
    mask = _slice_mask(2, initial[0].numel())
    first, second = initial[0][mask], initial[1][mask]
    average = (first + second) / 2
    # the figure read from the two workers' stage tensors directly: ||x1 - x2|| / ||x1 + x2||
    two_workers = float((first - second).double().norm() / (first + second).double().norm())
    assert results[0][0].drift_before == pytest.approx(two_workers, rel=1e-5)
    assert results[1][0].drift_before == pytest.approx(two_workers, rel=1e-5)
    for index, (report, flat) in enumerate(results):
        assert report.ok and report.fraction == 1.0, report
        assert report.drift_before == pytest.approx(_relative_l2(initial[index][mask], average), rel=1e-5)
        assert report.drift_after == pytest.approx(_relative_l2(flat[mask], average), rel=1e-4, abs=1e-6)
    assert results[1][0].drift_after == pytest.approx(0.25 * math.sqrt(mask.sum()) / float(average.norm()), rel=1e-4)
    assert results[0][0].drift_after < 1e-6 and results[2][0].drift_after < 1e-6
    assert results[2][0].drift_before > results[0][0].drift_before  # worker 2 (seed 42, 3x the scale) is the outlier


def test_peer_killed_mid_round_is_dropped_and_the_next_round_works() -> None:
    swarm = Swarm(
        3, freeze=(2,), spawn=(1,)
    )  # peer 1 runs in a spawned host, where hivemind's averager must still fork
    try:
        initial = swarm.set_values([_initial_values(seed + 40) for seed in range(3)])
        for index, weight in enumerate([1.0, 1.0, 1.0]):
            swarm.conns[index].send(("round", 0, weight, 0.0))
        assert swarm._recv(2) == "grouped"  # the victim is in the group and holds back its slice
        time.sleep(0.5)
        swarm.kill(2)
        results = [swarm._recv(index) for index in (0, 1)]
        total = initial[0].numel()
        mask = _slice_mask(0, total)
        pair_mean = (initial[0] + initial[1]) / 2
        for index, (report, flat) in enumerate(results):
            assert report.ok and report.group_size == 3, report
            assert 0.0 < report.fraction < 1.0 and "dropped" in report.reason, report
            averaged = (flat[mask] - pair_mean[mask]).abs() < 1e-5
            kept = flat[mask] == initial[index][mask]
            assert bool((averaged | kept).all()), "each element is either averaged or keeps its local value"
            assert int(averaged.sum()) == round(report.fraction * int(mask.sum())), report

        partition = StridedPartition([torch.Size(shape).numel() for shape in SHAPES], PARTITIONS)
        for report, _ in swarm.round([0, 1], 1, [1.0, 1.0]):
            assert report.ok and report.group_size == 2 and report.fraction == 1.0, report
            # with two peers the butterfly moves exactly one slice each way: fraction x params x 4 bytes
            formula = CONFIG.fraction * total * 4
            assert abs(report.bytes_sent - formula) <= 0.1 * formula, report
            assert abs(report.bytes_received - formula) <= 0.1 * formula, report
            # exactly what arrived; what this peer sent may still lag by its last averaged part, which its reducer
            # yields to the groupmate while the groupmate's parts already completed this peer's round
            assert abs(report.bytes_received - _expected_traffic(2, partition.slice_size(1))) <= 0.01 * formula
        assert swarm.close() == [("stopped", False)] * 2, "the survivors shut down cleanly"
    finally:
        swarm.close()


def test_a_stop_mid_allreduce_leaves_at_once() -> None:
    # the groupmate never sends its parts: the all-reduce would wait a minute for them, a stop must not
    config = CONFIG.model_copy(update={"sender_timeout": 60.0, "reducer_timeout": 60.0})
    swarm = Swarm(2, freeze=(1,), config=config)
    try:
        swarm.conns[1].send(("round", 0, 1.0, 0.0))
        swarm.conns[0].send(("begin", 0))
        assert swarm._recv(0) == "begun" and swarm._recv(1) == "grouped"
        swarm.conns[0].send(("shutdown_mid_allreduce", 1))
        stop_s, reports = swarm._recv(0)
        assert stop_s < 20.0, f"the stop took {stop_s:.1f} s: it waited for the all-reduce"
        assert [(report.ok, report.reason) for report in reports] == [(False, SHUTTING_DOWN)] * 2, reports
        swarm.kill(1)  # frozen for good: it would never answer a stop
    finally:
        swarm.close()


def test_a_round_that_reaches_its_step_after_the_stop_leaves_at_once() -> None:
    # hivemind's step waits without a bound for its process to take it, and a stopped process takes nothing
    swarm = Swarm(1, stop_before_step=(0,))
    try:
        swarm.conns[0].send(("shutdown_before_step", 0))
        stop_s, reports = swarm._recv(0, timeout=60.0)
        assert stop_s < 20.0, f"the stop took {stop_s:.1f} s"
        assert [(report.ok, report.reason) for report in reports] == [(False, SHUTTING_DOWN)], reports
    finally:
        swarm.close()


def test_a_poisoning_peer_moves_honest_weights_at_most_by_the_bound() -> None:
    swarm = Swarm(3, config=TIGHT)
    try:
        honest = _initial_values(50)
        total = sum(value.numel() for value in honest)
        for round_no, poison in enumerate((float("nan"), 1e30)):
            noise = torch.Generator().manual_seed(round_no)
            values = [[value + 0.01 * torch.randn(value.shape, generator=noise) for value in honest] for _ in range(2)]
            values.append([torch.full_like(value, poison) for value in honest])
            before = swarm.set_values(values)
            mask = _slice_mask(round_no, total)
            results = swarm.round([0, 1, 2], round_no, [1.0, 1.0, 1.0])
            for index in (0, 1):
                report, after = results[index]
                assert bool(torch.isfinite(after).all()), f"honest peer {index} got non-finite weights from {poison}"
                assert torch.equal(after[~mask], before[index][~mask]), "only the round's slice moves"
                moved = float((after[mask].double() - before[index][mask].double()).norm())
                own = float(before[index][mask].double().norm())
                bound = TIGHT.max_peer_delta * own + FLOOR_RMS * int(mask.sum()) ** 0.5
                assert moved <= bound * (1 + 1e-4), (poison, moved, bound)
                assert report.group_size == 3, report
                assert [peer for peer, _ in report.suspects] == [swarm.peer_ids[2]], report.suspects
                if poison != poison:  # NaN: nothing of it is used; each element is the honest pair's mean or our own
                    pair_mean = (before[0][mask] + before[1][mask]) / 2
                    averaged = (after[mask] - pair_mean).abs() < 1e-5
                    kept = after[mask] == before[index][mask]
                    assert bool((averaged | kept).all()) and bool(averaged.any()), "the honest pair still averages"
        assert swarm.close() == [("stopped", False)] * 3
    finally:
        swarm.close()


def test_only_ticketed_workers_of_the_stage_average_together(tmp_path: Any) -> None:
    """A stranger with a valid ticket for another stage (every other refusal reason: test_request_guards.py)."""
    key_path = tmp_path / "signing_key.pem"
    save_signing_key(generate_signing_key(), key_path)
    swarm = Swarm(3, tickets=(str(key_path), ["body1", "body1", "body2"]))
    try:
        honest = [_initial_values(0), _initial_values(1)]
        stranger = [torch.full_like(value, 1000.0) for value in honest[0]]
        total = sum(value.numel() for value in stranger)
        for round_no in range(2):
            before = swarm.set_values([*honest, stranger])
            mask = _slice_mask(round_no, total)
            results = swarm.round([0, 1, 2], round_no, [1.0, 1.0, 1.0], late=(2,))
            pair_mean = (before[0][mask] + before[1][mask]) / 2
            for index in (0, 1):
                report, after = results[index]
                assert report.ok and report.group_size == 2, report  # the stranger was refused at the door
                assert torch.allclose(after[mask], pair_mean, atol=1e-5), (
                    "the honest pair averaged, the stranger not at all"
                )
            stranger_report, stranger_after = results[2]
            assert not stranger_report.ok and torch.equal(stranger_after, before[2]), stranger_report
        refused = {reason: count for index in (0, 1) for reason, count in swarm.refusals(index).items()}
        assert refused.get("wrong_stage", 0) >= 1, refused

        # the stranger leads: the honest members see its ticket in the gathered data and refuse the whole group
        before = swarm.set_values([*honest, stranger])
        results = swarm.round([0, 1, 2], 2, [1.0, 1.0, 1.0], late=(0, 1))
        for index in (0, 1):
            report, after = results[index]
            if report.ok:  # the honest pair may still have found each other
                assert report.group_size == 2, report
            else:
                assert torch.equal(after, before[index]), "a refused group changes nothing"
        reasons = [results[index][0].reason or "" for index in (0, 1)]
        assert any(reason.startswith(f"refused: peer {swarm.peer_ids[2]}") for reason in reasons), reasons
    finally:
        swarm.close()


def _uniform_values(seed: int) -> list[torch.Tensor]:
    # no value beyond 3 standard deviations: each one decodes within half of its 8-bit bucket
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=generator) * 2 - 1) * (seed + 1) for shape in SHAPES]


# wire bytes per value (parts out + answers back, each way) relative to fp32's 4 + 4: bf16 parts go out in
# 2 bytes and come back as float32; int8 parts and answers are 1 byte plus a 1 KiB codebook per message.
# A peer's sent + received bytes are the same whatever share of the parts it reduces (the shares follow the
# measured links, which differ from round to round); each way alone is not.
WIRE_RATIO = {"bf16": 6 / 8, "int8": 2 / 8}
CODEBOOK_BYTES = 8 + 256 * 4


@pytest.mark.parametrize("payload", ["bf16", "int8"])
def test_compressed_rounds_move_fewer_bytes_and_reach_the_fp32_average(payload: str) -> None:
    # a machine loaded by other tests has held a part back past 4 s; a part lost would make the round partial
    config = CONFIG.model_copy(update={"payload": payload, "sender_timeout": 8.0, "reducer_timeout": 8.0})
    swarm = Swarm(2, config=config)
    try:
        initial = swarm.set_values([_uniform_values(seed) for seed in (0, 1)])
        total = initial[0].numel()
        mask, mean = _slice_mask(0, total), torch.stack(initial).mean(0)
        if payload == "bf16":  # 8 significant bits: half a unit in the last place, relative
            step = 2.0**-8 * float(torch.stack(initial)[:, mask].abs().max())
        else:  # 256 buckets over 6 standard deviations of the widest part sent
            step = 6 * max(float(flat[mask].std()) for flat in initial) / 256
        slice_size = int(mask.sum())
        part_values = SlicePayload(payload, torch.zeros(slice_size)).part_values
        codebooks = 0 if payload == "bf16" else math.ceil(slice_size / part_values) * CODEBOOK_BYTES
        expected = _expected_traffic(2, slice_size) * WIRE_RATIO[payload]
        for round_no in (0, PARTITIONS):  # the same slice twice: the second round sends what the first dropped
            results = swarm.round([0, 1], round_no, [1.0, 1.0])
            for report, _ in results:
                assert report.ok and report.fraction == 1.0 and report.reason is None, report
                moved = report.bytes_sent + report.bytes_received
                assert abs(moved - 2 * expected) <= 0.1 * 2 * expected + 2 * codebooks, (report, expected)
        (_, first), (_, second) = results
        for index, after in enumerate((first, second)):
            assert torch.equal(after[~mask], initial[index][~mask]), "only the round's slice moves"
            assert float((after[mask] - mean[mask]).abs().max()) <= step, "within a step of the fp32 average"
        assert float((first[mask] - second[mask]).abs().max()) <= step, "the peers agree within a step"
    finally:
        swarm.close()
