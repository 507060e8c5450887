"""Routing core of the trainer: least-loaded choice, learned durations, bans, sync phases, error classes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import random
import threading
from collections.abc import Callable

import pytest
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure, P2PDaemonError, P2PHandlerError
from hivemind.proto import test_pb2

from agora_client.discovery.roster import WorkerRecord
from agora_client.trainer.balancer import RoundRobinBalancer, Router, StageBalancer
from agora_client.trainer.errors import ErrorClass, RetryPolicy, WorkerVanishedError, classify


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(n: int, stage: str = "body1", phase: int = 0) -> WorkerRecord:
    return WorkerRecord(uid=f"{stage}.0.{n}", peer_id=f"peer{n}", stage=stage, sync_phase=phase)


def simulate(
    balancer: StageBalancer, clock: FakeClock, seconds_per_unit: dict[str, float], requests: int, concurrency: int = 4
) -> tuple[dict[str, int], float]:
    """Drive the balancer like a pipeline with `concurrency` microbatches in flight.

    Each worker serves its requests one after another (a queue on the worker), so sending more to a
    slow worker makes callers wait longer. Returns requests per uid and the simulated makespan.
    """
    start = clock.now
    busy_until = {uid: clock.now for uid in seconds_per_unit}
    done: list[tuple[float, int, object]] = []
    served = {uid: 0 for uid in seconds_per_unit}
    issued = 0
    order = 0

    def issue() -> None:
        nonlocal issued, order
        lease = balancer.choose("forward", units=1)
        assert lease is not None
        uid = lease.worker.uid
        finish = max(clock.now, busy_until[uid]) + seconds_per_unit[uid]
        busy_until[uid] = finish
        heapq.heappush(done, (finish, order, lease))
        issued += 1
        order += 1

    for _ in range(concurrency):
        issue()
    while done:
        finish, _, lease = heapq.heappop(done)
        clock.now = finish
        balancer.report_success(lease)  # duration measured on the fake clock: queueing included
        served[lease.worker.uid] += 1
        if issued < requests:
            issue()
    return served, clock.now - start


# least-loaded choice -----------------------------------------------------------------------------


def test_concurrent_choices_spread_and_least_loaded_goes_next() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", clock=clock)
    balancer.update_roster([worker(0), worker(1), worker(2)])

    leases = [balancer.choose("forward", units=1) for _ in range(3)]
    assert {lease.worker.uid for lease in leases} == {"body1.0.0", "body1.0.1", "body1.0.2"}

    for lease, seconds in zip(leases, (0.5, 0.2, 0.9), strict=True):
        balancer.report_success(lease, duration_s=seconds)
    # runtimes are now 0.5, 0.2, 0.9; each choice charges the chosen worker its learned estimate up front
    concurrent = [balancer.choose("forward").worker.uid[-1] for _ in range(5)]
    assert concurrent == ["1", "1", "0", "1", "1"]  # 0.2->0.4->0.6, then 0.5->1.0, then 0.6->0.8->1.0
    assert balancer.estimate(("body1.0.2", "peer2"), "forward") == pytest.approx(0.9)


def test_prefer_and_exclude() -> None:
    balancer = StageBalancer("body1", clock=FakeClock())
    balancer.update_roster([worker(0), worker(1)])
    first = balancer.choose("forward")
    assert balancer.choose("backward", prefer=first.key).key == first.key  # backward follows its forward
    assert balancer.choose("forward", exclude={first.key}).key != first.key
    assert balancer.choose("forward", exclude={worker(0).key, worker(1).key}) is None


def test_slow_worker_gets_smaller_share_than_fast_one() -> None:
    speeds = {"body1.0.0": 0.1, "body1.0.1": 0.3}  # the second worker is three times slower
    roster = [worker(0), worker(1)]

    clock = FakeClock()
    least_loaded = StageBalancer("body1", clock=clock)
    least_loaded.update_roster(roster)
    served, makespan = simulate(least_loaded, clock, speeds, requests=400)

    rr_clock = FakeClock()
    round_robin = RoundRobinBalancer("body1", clock=rr_clock)
    round_robin.update_roster(roster)
    rr_served, rr_makespan = simulate(round_robin, rr_clock, speeds, requests=400)

    fast, slow = served["body1.0.0"], served["body1.0.1"]
    assert fast + slow == 400
    assert 2.0 <= fast / slow <= 4.5  # close to the 3x speed ratio
    assert abs(rr_served["body1.0.0"] - rr_served["body1.0.1"]) <= 1  # the baseline ignores speed
    assert makespan < rr_makespan  # and so the pipeline waits on the slow worker
    assert least_loaded.stats().served == served


def pipeline_throughput(make: Callable[..., StageBalancer], inflight: int, microbatches: int = 600) -> float:
    """Microbatches per simulated second through head -> body1 -> body2 -> tail and back, ``inflight`` at once.

    Every worker has its own hardware (a queue served one request at a time, 0.1 s each); body1 has a
    second worker three times slower. A backward goes to the worker that ran its forward, as in the pipeline.
    Each request takes its worker's time +-20 % (seeded), as real ones vary: with exact times, microbatches
    that once queue behind each other stay in that convoy for the rest of the run, so a single detour (a
    balancer's probe) would decide the result.
    """
    clock = FakeClock()
    jitter = random.Random(0)
    stages = ("head", "body1", "body2", "tail")
    balancers = {stage: make(stage, clock=clock) for stage in stages}
    seconds = {f"{stage}.0.0": 0.1 for stage in stages} | {"body1.0.1": 0.3}
    for stage, balancer in balancers.items():
        balancer.update_roster([worker(0, stage)] + ([worker(1, stage)] if stage == "body1" else []))
    route = [(stage, "forward") for stage in stages] + [(stage, "backward") for stage in reversed(stages)]
    busy_until = dict.fromkeys(seconds, clock.now)
    pending: list = []
    order = itertools.count()

    def issue(step: int, forward_on: dict) -> None:
        stage, kind = route[step]
        lease = balancers[stage].choose(kind, prefer=forward_on.get(stage) if kind == "backward" else None)
        uid = lease.worker.uid
        busy_until[uid] = max(clock.now, busy_until[uid]) + seconds[uid] * jitter.uniform(0.8, 1.2)
        heapq.heappush(pending, (busy_until[uid], next(order), step, lease, forward_on))

    for _ in range(inflight):
        issue(0, {})
    started, start = inflight, clock.now
    while pending:
        clock.now, _, step, lease, forward_on = heapq.heappop(pending)
        balancers[route[step][0]].report_success(lease)
        forward_on = {**forward_on, route[step][0]: lease.key}
        if step + 1 < len(route):
            issue(step + 1, forward_on)
        elif started < microbatches:
            started += 1
            issue(0, {})
    return microbatches / (clock.now - start)


@pytest.mark.parametrize("inflight", [2, 3, 8])
def test_least_loaded_beats_round_robin_by_a_third_with_one_worker_three_times_slower(inflight: int) -> None:
    # round-robin sends every other microbatch through the slow worker; least-loaded only when that is faster
    ratio = pipeline_throughput(StageBalancer, inflight) / pipeline_throughput(RoundRobinBalancer, inflight)
    assert ratio >= 1.3, ratio


def test_new_worker_enters_at_the_back() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", clock=clock)
    balancer.update_roster([worker(0), worker(1)])
    simulate(balancer, clock, {"body1.0.0": 0.1, "body1.0.1": 0.1}, requests=200, concurrency=1)

    balancer.update_roster([worker(0), worker(1), worker(2)])  # a newcomer, as fast as the others
    counts = {"body1.0.0": 0, "body1.0.1": 0, "body1.0.2": 0}
    for _ in range(30):
        lease = balancer.choose("forward")
        counts[lease.worker.uid] += 1
        clock.now += 0.1
        balancer.report_success(lease, duration_s=0.1)
    # it takes its fair third at most, instead of everything until it has caught up 10 s of runtime
    assert 1 <= counts["body1.0.2"] <= 11
    assert counts["body1.0.0"] >= 9 and counts["body1.0.1"] >= 9


def test_stream_of_slow_joiners_does_not_take_load_from_fast_workers() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", clock=clock)
    speeds = {"body1.0.0": 0.1, "body1.0.1": 0.1}
    roster = [worker(0), worker(1)]
    balancer.update_roster(roster)
    simulate(balancer, clock, speeds, requests=100)

    fast_share = []
    for n in range(2, 7):  # five slow workers join one after another
        roster.append(worker(n))
        speeds[f"body1.0.{n}"] = 1.0
        balancer.update_roster(roster)
        served, _ = simulate(balancer, clock, speeds, requests=20)  # the 20 requests right after the join
        fast_share.append((served["body1.0.0"] + served["body1.0.1"]) / 20)
    # entering at the front (runtime 0) would hand each joiner ~40 % of these until it caught up
    assert sum(fast_share) / len(fast_share) >= 0.8 and min(fast_share) >= 0.7


def test_a_worker_kept_out_by_one_slow_answer_is_probed_and_taken_back() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", probe_after_s=10.0, clock=clock)
    balancer.update_roster([worker(0), worker(1)])
    first, second = balancer.choose("forward"), balancer.choose("forward")
    assert {first.worker.uid, second.worker.uid} == {"body1.0.0", "body1.0.1"}
    balancer.report_success(*((first, 5.0) if first.worker.uid == "body1.0.0" else (second, 5.0)))  # a busy moment
    balancer.report_success(*((second, 0.1) if first.worker.uid == "body1.0.0" else (first, 0.1)))

    def serve(seconds: float) -> dict[str, int]:
        counts = {"body1.0.0": 0, "body1.0.1": 0}
        end = clock.now + seconds
        while clock.now < end:
            lease = balancer.choose("forward")
            counts[lease.worker.uid] += 1
            clock.now += 0.1
            balancer.report_success(lease, duration_s=0.1)  # both are really fast
        return counts

    assert serve(9.5)["body1.0.0"] == 0  # its one slow answer keeps it out while the estimate is fresh
    recovered = serve(10.0)
    assert recovered["body1.0.0"] >= 40, recovered  # probed once its estimate went stale, then back in turn
    assert balancer.estimate(worker(0).key, "forward") == pytest.approx(0.1)  # the probe replaced the old average


def test_a_really_slow_worker_pays_one_probe_per_period() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", probe_after_s=10.0, clock=clock)
    balancer.update_roster([worker(0), worker(1)])
    served, _ = simulate(balancer, clock, {"body1.0.0": 0.1, "body1.0.1": 2.0}, requests=600, concurrency=1)
    # ~60 s of work: without probes the slow worker would get its first request only; probes add one per 10 s
    assert 2 <= served["body1.0.1"] <= 8, served


# bans and roster ---------------------------------------------------------------------------------


def test_unreachable_worker_is_banned_until_ban_expires() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", ban_seconds=30, clock=clock)
    balancer.update_roster([worker(0)])
    lease = balancer.choose("forward")
    verdict = balancer.report_failure(lease, P2PDaemonError("failed to dial: all dials failed"))
    assert verdict.error_class is ErrorClass.RETRY_OTHER and verdict.banned
    assert balancer.choose("forward") is None
    assert balancer.stats().banned == 1 and balancer.stats().bans == 1

    clock.now += 29.9
    assert balancer.choose("forward") is None
    clock.now += 0.2
    assert balancer.choose("forward").worker.uid == "body1.0.0"
    assert balancer.stats().banned == 0


def test_ban_seconds_is_configurable() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", ban_seconds=5, clock=clock)
    balancer.update_roster([worker(0)])
    balancer.report_failure(balancer.choose(), ConnectionRefusedError())
    clock.now += 5
    assert balancer.choose() is not None


def test_explicit_ban() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", clock=clock)
    balancer.update_roster([worker(0), worker(1)])
    balancer.ban(worker(0).key, seconds=10)
    assert {balancer.choose().worker.uid for _ in range(4)} == {"body1.0.1"}
    clock.now += 10
    assert balancer.choose(exclude={worker(1).key}).worker.uid == "body1.0.0"


def test_vanished_banned_worker_is_forgotten() -> None:
    clock = FakeClock()
    balancer = StageBalancer("body1", clock=clock)
    balancer.update_roster([worker(0), worker(1)])
    balancer.report_failure(balancer.choose(exclude={worker(1).key}), P2PDaemonError("stream reset"))
    assert balancer.stats().banned == 1

    balancer.update_roster([worker(1)])
    stats = balancer.stats()
    assert (stats.workers, stats.banned, stats.ready) == (1, 0, 1)

    balancer.update_roster([worker(0), worker(1)])  # announced again: a fresh worker, not banned
    assert balancer.choose(exclude={worker(1).key}).worker.uid == "body1.0.0"


def test_repeated_timeouts_ban_a_worker() -> None:
    balancer = StageBalancer("body1", max_transient_streak=3, clock=FakeClock())
    balancer.update_roster([worker(0)])
    verdicts = [balancer.report_failure(balancer.choose(), asyncio.TimeoutError()) for _ in range(3)]
    assert [v.error_class for v in verdicts] == [ErrorClass.RETRY_SAME, ErrorClass.RETRY_SAME, ErrorClass.RETRY_OTHER]
    assert [v.banned for v in verdicts] == [False, False, True]
    assert balancer.choose() is None


def test_rejected_request_keeps_the_worker() -> None:
    balancer = StageBalancer("body1", clock=FakeClock())
    balancer.update_roster([worker(0)])
    verdict = balancer.report_failure(balancer.choose(), P2PHandlerError("ValueError('shape mismatch')"))
    assert verdict.error_class is ErrorClass.FATAL and not verdict.banned
    assert balancer.choose() is not None
    stats = balancer.stats()
    assert (stats.rejected, stats.retries, stats.bans) == (1, 0, 0)


def test_lease_of_a_worker_that_left_and_came_back_is_ignored() -> None:
    balancer = StageBalancer("body1", clock=FakeClock())
    balancer.update_roster([worker(0)])
    lease = balancer.choose()
    balancer.update_roster([])
    balancer.update_roster([worker(0)])
    balancer.report_success(lease, duration_s=5.0)
    assert balancer.stats().in_flight == 0
    assert balancer.estimate(worker(0).key, "forward") is None  # the new incarnation learned nothing from it


def test_phase1_workers_are_skipped_phase2_and_active_are_eligible() -> None:
    balancer = StageBalancer("body1", clock=FakeClock())
    balancer.update_roster([worker(0, phase=1), worker(1, phase=2), worker(2, phase=0)])
    chosen = {balancer.choose().worker.uid for _ in range(6)}
    assert chosen == {"body1.0.1", "body1.0.2"}
    stats = balancer.stats()
    assert (stats.workers, stats.syncing, stats.ready) == (3, 1, 2)

    balancer.update_roster([worker(0, phase=2)])  # finished phase 1
    assert balancer.choose().worker.uid == "body1.0.0"


def test_record_of_another_stage_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="belongs to stage 'body2'"):
        StageBalancer("body1").update_roster([worker(0, stage="body2")])


def test_thread_safety_under_concurrent_use() -> None:
    balancer = StageBalancer("body1")
    balancer.update_roster([worker(n) for n in range(4)])
    failures = []

    def run() -> None:
        for i in range(300):
            lease = balancer.choose("forward", units=8)
            if lease is None:
                failures.append("no worker")
            elif i % 50 == 0:
                balancer.report_failure(lease, asyncio.TimeoutError())
            else:
                balancer.report_success(lease, duration_s=0.01)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = balancer.stats()
    assert failures == []
    assert stats.in_flight == 0
    assert stats.done + stats.retries == 1800
    assert sum(stats.served.values()) == stats.done


# router ------------------------------------------------------------------------------------------


def test_router_reports_empty_stages_and_window_stats() -> None:
    clock = FakeClock()
    router = Router(["head", "body1", "tail"], lambda stage: StageBalancer(stage, clock=clock))
    assert router.empty_stages() == ["head", "body1", "tail"]
    unknown = router.update_roster([worker(0, "head"), worker(1, "body1"), worker(2, "tail"), worker(3, "body9")])
    assert unknown == 1
    assert router.all_stages_ready()

    lease = router["body1"].choose()
    router["body1"].report_failure(lease, ControlFailure("Connect failed. msg=failed to find any peer in table"))
    assert router.empty_stages() == ["body1"] and not router.all_stages_ready()

    first = router.window_stats()
    assert first["body1"].bans == 1 and first["body1"].banned == 1
    router["head"].report_success(router["head"].choose(), duration_s=0.1)
    second = router.window_stats()
    assert second["body1"].bans == 0 and second["body1"].banned == 1  # counters per window, states current
    assert second["head"].done == 1 and second["head"].served == {"head.0.0": 1}
    assert "body1: 0/1 ready, 0 syncing, 1 banned" in second["body1"].summary()

    clock.now += 30
    assert router.all_stages_ready()  # resumes by itself once the ban is over


# error classification ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (asyncio.TimeoutError(), ErrorClass.RETRY_SAME),
        (concurrent.futures.TimeoutError(), ErrorClass.RETRY_SAME),
        (P2PDaemonError("context deadline exceeded"), ErrorClass.RETRY_SAME),
        (
            P2PDaemonError("failed to dial: failed to dial 12D3: all dials failed\n * connection refused"),
            ErrorClass.RETRY_OTHER,
        ),
        (
            ControlFailure("Connect failed. msg=failed to dial: all dials failed\n * dial backoff"),
            ErrorClass.RETRY_OTHER,
        ),
        (P2PDaemonError("failed to find any peer in table"), ErrorClass.RETRY_OTHER),
        (P2PDaemonError("stream reset"), ErrorClass.RETRY_OTHER),
        (P2PDaemonError("failed to negotiate protocol: protocols not supported: [x]"), ErrorClass.RETRY_OTHER),
        (P2PDaemonError("Message size exceeds set limit 1024"), ErrorClass.FATAL),
        (ConnectionResetError(), ErrorClass.RETRY_OTHER),
        (BrokenPipeError(), ErrorClass.RETRY_OTHER),
        (asyncio.IncompleteReadError(b"", 8), ErrorClass.RETRY_OTHER),
        (WorkerVanishedError("no tensors in reply"), ErrorClass.RETRY_OTHER),
        (
            ValueError("asingle() expected an iterable with exactly one item, but got an empty iterable"),
            ErrorClass.RETRY_OTHER,
        ),
        (P2PHandlerError("ValueError('shape mismatch: expected [8, 127, 32]')"), ErrorClass.FATAL),
        (P2PHandlerError("Failed to call handler `rpc_forward` at 12D3: expected dtype int64"), ErrorClass.FATAL),
        (P2PHandlerError("RuntimeError('CUDA out of memory. Tried to allocate 2 GiB')"), ErrorClass.RETRY_OTHER),
        (P2PHandlerError("KeyError('body1.0.3')"), ErrorClass.RETRY_OTHER),
        # a worker that is stopping: never a reason to give the microbatch up
        (P2PHandlerError("RuntimeError('cannot schedule new futures after shutdown')"), ErrorClass.RETRY_OTHER),
        (
            P2PHandlerError("Failed to call handler `rpc_backward` at 12D3: Event loop is closed"),
            ErrorClass.RETRY_OTHER,
        ),
        (P2PHandlerError("CancelledError()"), ErrorClass.RETRY_OTHER),
        (P2PHandlerError("TimeoutError('task pool timed out')"), ErrorClass.RETRY_SAME),
        (TypeError("unsupported operand"), ErrorClass.FATAL),
    ],
)
def test_classify(error: BaseException, expected: ErrorClass) -> None:
    assert classify(error) is expected


def test_classify_follows_the_cause_of_a_wrapper() -> None:
    try:
        try:
            raise ConnectionResetError("peer went away")
        except ConnectionResetError as cause:
            raise RuntimeError("forward failed") from cause
    except RuntimeError as wrapper:
        assert classify(wrapper) is ErrorClass.RETRY_OTHER


def test_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=3, max_same_worker=2)
    assert policy.next_step(ErrorClass.RETRY_SAME, attempts=1, attempts_on_worker=1) is ErrorClass.RETRY_SAME
    assert policy.next_step(ErrorClass.RETRY_SAME, attempts=2, attempts_on_worker=2) is ErrorClass.RETRY_OTHER
    assert policy.next_step(ErrorClass.RETRY_OTHER, attempts=1, attempts_on_worker=1) is ErrorClass.RETRY_OTHER
    assert policy.next_step(ErrorClass.RETRY_OTHER, attempts=3, attempts_on_worker=1) is None
    assert policy.next_step(ErrorClass.FATAL, attempts=1, attempts_on_worker=1) is None
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


async def test_classify_real_hivemind_failures() -> None:
    """Errors as raised by real p2pd peers: a rejecting handler, a peer killed mid-call, a dead peer."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = None
    try:
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())

        async def reject(request: test_pb2.TestRequest, context) -> test_pb2.TestResponse:
            raise ValueError("shape mismatch: expected [8, 127, 32]")

        async def hang(request: test_pb2.TestRequest, context) -> test_pb2.TestResponse:
            await asyncio.sleep(60)
            return test_pb2.TestResponse(number=0)

        await server.add_protobuf_handler("reject", reject, test_pb2.TestRequest)
        await server.add_protobuf_handler("hang", hang, test_pb2.TestRequest)

        async def call(name: str) -> BaseException:
            request = test_pb2.TestRequest(number=1)
            try:
                await asyncio.wait_for(
                    client.call_protobuf_handler(server.peer_id, name, request, test_pb2.TestResponse), 20
                )
            except Exception as error:  # the point of the test is what comes out
                return error
            raise AssertionError(f"call to {name} succeeded")

        assert classify(await call("reject")) is ErrorClass.FATAL
        assert classify(await call("missing")) is ErrorClass.RETRY_OTHER  # peer alive, handler gone

        pending = asyncio.create_task(call("hang"))
        await asyncio.sleep(0.5)
        await server.shutdown()  # the worker dies mid-call
        assert classify(await pending) is ErrorClass.RETRY_OTHER
        assert classify(await call("reject")) is ErrorClass.RETRY_OTHER  # and cannot be dialled any more
    finally:
        await server.shutdown()
        if client is not None:
            await client.shutdown()
