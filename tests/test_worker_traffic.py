"""Counting where it happens: the request meter shared with forked handlers, traffic rates, swarm loss
records, engine logs as events, and the stop signal every role shares."""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agora_client.events import EventWriter, parse_event
from agora_client.serving.traffic import RequestMeter, TrafficWindow
from agora_client.system.log_events import EventLogHandler
from agora_client.trainer.progress import TrainerProgress, swarm_event

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(60)


def _serve(meter: RequestMeter, count: int) -> None:
    for _ in range(count):
        meter.on_request("backward", 100, 40)
    meter.on_request("forward", 10, 20)


def test_requests_counted_in_forked_handlers_reach_the_worker():
    meter = RequestMeter()
    handlers = [mp.get_context("fork").Process(target=_serve, args=(meter, 50)) for _ in range(2)]
    for handler in handlers:
        handler.start()
    for handler in handlers:
        handler.join(10)
    meter.on_transfer(sent=1000, received=3000)  # a SPARTA round
    totals = meter.totals()
    assert (totals.forward, totals.backward) == (2, 100)
    assert (totals.bytes_in, totals.bytes_out) == (2 * (50 * 100 + 10) + 3000, 2 * (50 * 40 + 20) + 1000)


def test_traffic_rates_over_the_window():
    meter, now = RequestMeter(), [0.0]
    window = TrafficWindow(meter, window_s=30.0, clock=lambda: now[0])
    for second in range(1, 61):
        now[0] = float(second)
        meter.on_request("forward", 1000, 0)
        meter.on_request("backward", 0, 500)
        event = window.sample()
    assert event.forward_per_min == pytest.approx(60.0) and event.backward_per_min == pytest.approx(60.0)
    assert event.download_bps == pytest.approx(1000.0) and event.upload_bps == pytest.approx(500.0)
    assert event.window_s <= 31 and (event.forward_total, event.backward_total) == (60, 60)


def test_swarm_loss_from_the_trainers_records():
    records = [
        TrainerProgress(peer_id="a", microbatches=10, loss=4.0, history=[(1.0, 5.0), (3.0, 4.0)], ts=3.0),
        TrainerProgress(
            peer_id="b", microbatches=12, loss=3.0, tokens_per_s=100, history=[(2.0, 4.5), (4.0, 3.0)], ts=4.0
        ),
        TrainerProgress(peer_id="c", microbatches=0, loss=None, ts=4.0),
    ]
    event = swarm_event(records)
    assert event.trainers == 3 and event.loss == pytest.approx(3.5) and event.tokens_per_s == 100
    assert [loss for _, loss in event.loss_history] == [5.0, 4.5, 4.0, 3.0]  # merged by time
    assert swarm_event([]).loss is None


def test_engine_log_records_become_one_line_events():
    buffer = io.StringIO()
    logger = logging.getLogger("hivemind.moe.test")
    handler = EventLogHandler(EventWriter(buffer))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise ConnectionResetError("peer went away")
        except ConnectionResetError:
            logger.warning("lost a peer\nsecond line", exc_info=True)
        logging.getLogger("hivemind.averaging.test").addHandler(handler)
        logging.getLogger("hivemind.averaging.test").warning("AllreduceException: could not find a group")
    finally:
        logger.removeHandler(handler)
        logging.getLogger("hivemind.averaging.test").removeHandler(handler)
    first, second = (parse_event(line) for line in buffer.getvalue().splitlines())
    assert (
        first.level == "warning"
        and first.message == "hivemind.moe.test: lost a peer (ConnectionResetError: peer went away)"
    )
    assert "Traceback" not in buffer.getvalue()
    assert second.level == "debug"  # the round's own sparta event says it; not shown on screen


_STOPPER = """
import multiprocessing as mp, signal, sys, time
sys.path.insert(0, {root!r})
from agora_client.system.lifetime import stop_on_signals
stop = stop_on_signals()
child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
print("ready", flush=True)
stop.wait(30)
child.terminate()  # what hivemind does to its task pools: it must work
child.join(5)
print("child", child.exitcode, flush=True)
stop.clear()
"""


def test_stop_signal_leaves_forked_helpers_their_default_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-c", _STOPPER.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline().strip() == f"child {-signal.SIGTERM}"
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_second_signal_ends_the_process_at_once():
    code = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
        "from agora_client.system.lifetime import stop_on_signals\n"
        "stop = stop_on_signals(); print('ready', flush=True); stop.wait(30); time.sleep(30)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 128 + signal.SIGTERM and time.monotonic() - started < 5
    finally:
        if process.poll() is None:
            process.kill()
