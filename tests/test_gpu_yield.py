"""When a contributor gives the GPU back to its owner (issue 30, part 6): the policy (never / games / always, its
own processes and the desktop's left out, a free-for-a-while hysteresis), quiet hours on an injected clock, the
options' errors, the energy meter, the control that drains and resumes a worker, and the lines a front end prints.

NVML is not here: its answers come from a stand-in reader that returns what NVML's process lists would."""

from __future__ import annotations

import argparse
import io
import threading
from datetime import datetime

import pytest

from agora_client.events import EventWriter, YieldEvent, parse_event
from agora_client.frontend.lines import LineFormatter
from agora_client.joining.yield_control import YieldControl, wait_until_free
from agora_client.system.energy import MJ_PER_KWH, EnergyMeter
from agora_client.system.gpu_users import own_pids
from agora_client.system.gpu_yield import (
    PAUSED_REASON,
    RESUMED_REASON,
    ActiveHours,
    GpuUser,
    YieldPolicy,
    configure_yield,
    parse_active_hours,
    yield_argv,
)

NOON = datetime(2025, 1, 6, 12, 0)
GAME = GpuUser(4242, "Cyberpunk2077.exe", graphics=True)
TRAINING = GpuUser(777, "python3", graphics=False)
DESKTOP = [
    GpuUser(900, "Xorg", graphics=True),
    GpuUser(901, "firefox", graphics=True),
    GpuUser(902, "dwm.exe", graphics=True),
]


def reason(policy: YieldPolicy, users, now: float = 0.0, own: set[int] = frozenset(), when: datetime = NOON):
    return policy.reason(users, set(own), now=now, local_time=when)


def test_games_yields_to_a_graphics_program_and_lets_a_compute_job_share() -> None:
    policy = YieldPolicy("games")
    assert reason(policy, [TRAINING, *DESKTOP]) is None
    assert reason(policy, [TRAINING, GAME]) == "another process is using the GPU: Cyberpunk2077.exe pid 4242"


def test_always_yields_to_any_other_program_and_never_to_none() -> None:
    assert reason(YieldPolicy("always"), [TRAINING]) == "another process is using the GPU: python3 pid 777"
    assert reason(YieldPolicy("always"), DESKTOP) is None  # the desktop holds the card all day
    assert reason(YieldPolicy("never"), [GAME, TRAINING]) is None


def test_the_runtimes_own_processes_never_count() -> None:
    ours = GpuUser(own_pids().pop(), "python3", graphics=True)
    assert reason(YieldPolicy("always"), [ours], own=own_pids()) is None
    assert reason(YieldPolicy("always"), [ours, GAME], own=own_pids()) is not None


def test_it_rejoins_only_once_the_gpu_has_been_free_for_a_while() -> None:
    policy = YieldPolicy("games", free_for_s=60)
    assert reason(policy, [GAME], now=100) is not None
    waiting = reason(policy, [], now=130)
    assert waiting is not None and "waiting until the GPU has been free for 60 s" in waiting
    assert reason(policy, [GAME], now=150) is not None  # back again: the minute starts over
    assert reason(policy, [], now=209) is not None
    assert reason(policy, [], now=211) is None


@pytest.mark.parametrize(
    "text, start, end", [("22-08", 22, 8), ("9-17", 9, 17), ("22:00-08:00", 22, 8), ("24-6", 0, 6)]
)
def test_active_hours_parse(text: str, start: int, end: int) -> None:
    assert parse_active_hours(text) == ActiveHours(start, end)


def test_active_hours_wrap_midnight() -> None:
    night = parse_active_hours("22-08")
    inside = [datetime(2025, 1, 6, hour, minute) for hour, minute in ((22, 0), (23, 59), (0, 0), (7, 59))]
    outside = [datetime(2025, 1, 6, hour, minute) for hour, minute in ((8, 0), (12, 0), (21, 59))]
    assert all(night.contains(when) for when in inside) and not any(night.contains(when) for when in outside)
    office = parse_active_hours("09-17")
    assert office.contains(datetime(2025, 1, 6, 9)) and not office.contains(datetime(2025, 1, 6, 17))


@pytest.mark.parametrize(
    "text, says",
    [
        ("22", "not START-END in whole hours, e.g. 22-08"),
        ("10pm-8am", "e.g. 22-08"),
        ("25-08", "hours run from 0 to 24"),
        ("8-8", "leave the option out to contribute all day"),
        ("22:30-08", "whole hours"),
    ],
)
def test_bad_active_hours_say_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_active_hours(text)


def test_the_options_refuse_bad_input_and_reach_the_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    configure_yield(parser)
    for bad, says in (
        (["--active-hours", "25-3"], "hours run from 0 to 24"),
        (["--yield", "sometimes"], "invalid choice"),
        (["--yield-grace", "-5"], "give 0 or more seconds"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
        assert says in capsys.readouterr().err
    args = parser.parse_args([])
    assert (args.yield_mode, args.active_hours, args.yield_grace) == ("games", None, 600.0)  # the default
    args = parser.parse_args(["--yield", "always", "--active-hours", "22-08", "--yield-grace", "90"])
    assert parser.parse_args(yield_argv(args)) == args


def test_outside_active_hours_it_yields_whatever_runs() -> None:
    policy = YieldPolicy("never", parse_active_hours("22-08"))
    assert reason(policy, [], when=NOON) == "outside active hours 22-08"
    assert reason(policy, [], when=datetime(2025, 1, 6, 23)) is None


def test_energy_counts_only_serving_intervals() -> None:
    meter = EnergyMeter()
    assert meter.kwh is None and meter.points_per_kwh(10) is None
    meter.read(1_000, serving=True)  # the first reading is the baseline
    meter.read(1_000 + int(MJ_PER_KWH // 2), serving=True)
    meter.read(5 * int(MJ_PER_KWH), serving=False)  # a game's energy while the worker yielded
    meter.read(5 * int(MJ_PER_KWH) + int(MJ_PER_KWH // 2), serving=True)
    meter.read(10, serving=True)  # the driver reloaded: the counter restarted
    assert meter.kwh == pytest.approx(1.0) and meter.points_per_kwh(250) == pytest.approx(250)
    unsupported = EnergyMeter()
    unsupported.read(None, serving=True)
    assert unsupported.kwh is None


class Card:
    """What NVML's process lists and energy counter answer, as the test sets them."""

    def __init__(self) -> None:
        self.listed: list[GpuUser] = []
        self.energy = 0

    def users(self) -> list[GpuUser]:
        return list(self.listed)

    def energy_mj(self) -> int:
        return self.energy


class Worker:
    """The node's yield interface, recording what it was told."""

    def __init__(self) -> None:
        self.yielding, self.told = False, []

    def yield_gpu(self) -> None:
        self.yielding = True
        self.told.append("yield")

    def resume(self) -> None:
        self.yielding = False
        self.told.append("resume")


def events_of(sink: io.StringIO) -> list:
    return [parse_event(line) for line in sink.getvalue().splitlines()]


def test_the_control_drains_keeps_the_slot_for_the_grace_and_then_leaves() -> None:
    card, worker, clock, sink = Card(), Worker(), [0.0], io.StringIO()
    control = YieldControl(
        YieldPolicy("games", free_for_s=60),
        card,
        worker,
        EventWriter(sink),
        grace_s=300,
        clock=lambda: clock[0],
        local_time=lambda: NOON,
    )
    assert control.tick() and worker.told == []
    card.listed, card.energy = [GAME], int(MJ_PER_KWH)  # the serving interval used 1 kWh
    assert control.tick() and worker.told == ["yield"]
    card.energy = 3 * int(MJ_PER_KWH)  # the game's
    clock[0] = 30.0
    card.listed = []
    assert control.tick() and worker.told == ["yield"]  # free, but not for a minute yet
    clock[0] = 61.0
    assert control.tick() and worker.told == ["yield", "resume"]
    yields = [event for event in events_of(sink) if isinstance(event, YieldEvent)]
    assert [event.state for event in yields] == ["yielding", "yielding", "resumed"]
    assert yields[0].reason.endswith("Cyberpunk2077.exe pid 4242") and yields[0].grace_left_s == 300
    assert control.energy_event(points=50).kwh == pytest.approx(1.0)
    clock[0] = 100.0
    card.listed = [GAME]
    assert control.tick()
    clock[0] = 399.0
    assert control.tick()
    clock[0] = 401.0
    assert not control.tick()  # the grace ran out: the caller leaves the swarm
    last = events_of(sink)[-1]
    assert last.state == "left" and "the slot is given back" in last.reason


def test_a_pause_drains_whatever_the_mode_and_a_resume_serves_at_once() -> None:
    card, worker, sink = Card(), Worker(), io.StringIO()
    policy = YieldPolicy("never")
    control = YieldControl(policy, card, worker, EventWriter(sink), grace_s=300, clock=lambda: 0.0)
    assert control.tick() and worker.told == []
    assert policy.pause() and not policy.pause()  # the second says "already paused"
    assert control.tick() and worker.told == ["yield"]
    assert policy.resume() and not policy.resume()
    assert control.tick() and worker.told == ["yield", "resume"]  # no free-for-a-while wait after a pause
    yields = [(event.state, event.reason) for event in events_of(sink) if isinstance(event, YieldEvent)]
    assert yields == [("yielding", PAUSED_REASON), ("resumed", RESUMED_REASON)]
    formatter = LineFormatter()
    lines = [line.render() for event in events_of(sink) for line in formatter.format(event)]
    assert lines == [
        f"[YIELD] Yielding the GPU: {PAUSED_REASON} (the slot is kept for 5m more)",
        f"[YIELD] Serving again: {RESUMED_REASON}",
    ]


def test_before_a_join_it_waits_while_the_policy_says_yield() -> None:
    card, sink, stop = Card(), io.StringIO(), threading.Event()
    card.listed = [GAME]
    stop.set()
    assert not wait_until_free(YieldPolicy("games"), card, EventWriter(sink), stop, local_time=lambda: NOON)
    stop.clear()
    card.listed = []
    assert wait_until_free(YieldPolicy("games"), card, EventWriter(sink), stop, local_time=lambda: NOON)
    assert sink.getvalue() == ""  # free from the start: nothing to say
    clock, policy = [0.0], YieldPolicy("games", free_for_s=0.5)
    policy.reason([GAME], set(), now=0.0, local_time=NOON)  # the game has just closed
    timer = threading.Timer(0.1, lambda: clock.__setitem__(0, 1.0))
    timer.start()
    assert wait_until_free(policy, card, EventWriter(sink), stop, clock=lambda: clock[0], local_time=lambda: NOON)
    assert [event.state for event in events_of(sink)] == ["yielding", "resumed"]
    sink.seek(0), sink.truncate()
    quiet = YieldPolicy("never", parse_active_hours("22-08"))
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    assert not wait_until_free(quiet, card, EventWriter(sink), stop, local_time=lambda: NOON)
    assert [event.reason for event in events_of(sink)] == [
        "outside active hours 22-08; the worker joins once it may use the GPU"
    ]


def test_headless_lines_say_each_change_once() -> None:
    formatter = LineFormatter()
    say = [
        YieldEvent(state="yielding", reason="outside active hours 22-08", grace_left_s=600, ts=1),
        YieldEvent(state="yielding", reason="outside active hours 22-08", grace_left_s=590, ts=11),  # a countdown only
        YieldEvent(state="left", reason="yielded for 600 s", grace_left_s=0, ts=600),
        YieldEvent(state="resumed", reason="the GPU is free again", ts=700),
    ]
    lines = [line.render() for event in say for line in formatter.format(event)]
    assert lines == [
        "[YIELD] Yielding the GPU: outside active hours 22-08 (the slot is kept for 10m more)",
        "[YIELD] Left the swarm: yielded for 600 s",
        "[YIELD] Serving again: the GPU is free again",
    ]


class _FakeNvml:
    """pynvml's few functions GpuUsers calls, for one card: what a driver with a game and a training job would say."""

    class NVMLError(Exception):
        pass

    def __init__(self, energy: int | None):
        self.energy = energy

    def nvmlInit(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        if index != 0:
            raise self.NVMLError("invalid argument")
        return "card0"

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: str) -> list:
        return [argparse.Namespace(pid=GAME.pid)]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list:
        return [argparse.Namespace(pid=GAME.pid), argparse.Namespace(pid=TRAINING.pid)]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        if self.energy is None:
            raise self.NVMLError("not supported")  # cards before Volta
        return self.energy


@pytest.mark.parametrize("energy", [123_456, None])
def test_gpu_users_lists_graphics_first_once_and_reads_energy_through_the_probe(monkeypatch, energy) -> None:
    from agora_client.system import gpu
    from agora_client.system.gpu_users import GpuUsers

    monkeypatch.setattr(gpu, "_nvml", lambda: _FakeNvml(energy))
    card, absent, none = GpuUsers(0), GpuUsers(3), GpuUsers(None)
    assert [(user.pid, user.graphics) for user in card.users()] == [(GAME.pid, True), (TRAINING.pid, False)]
    assert card.energy_mj() == energy
    assert absent.users() == [] and absent.energy_mj() is None  # no such card: NVML's error is "nobody"
    assert none.users() == [] and none.energy_mj() is None
