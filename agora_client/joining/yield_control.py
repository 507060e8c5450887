"""The contributor gives the GPU back to its owner and takes it again; agora_client/system/gpu_yield.py says when.

While the worker is up, ``YieldControl.tick`` (once a second) drains it or lets it serve again and counts the
grace during which the slot is kept; before a join, ``wait_until_free`` holds the join back while the policy says
yield. Every change is a ``yield`` event; while yielding, one every ``REPORT_EVERY_S`` carries the grace left.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Callable

from agora_client.events import EnergyEvent, EventWriter, YieldEvent
from agora_client.system.energy import EnergyMeter
from agora_client.system.gpu_users import GpuUsers, own_pids
from agora_client.system.gpu_yield import PAUSED_REASON, RESUMED_REASON, YieldPolicy

if TYPE_CHECKING:
    from agora_client.worker.node import WorkerNode

REPORT_EVERY_S = 10.0
WAIT_TICK_S = 1.0


class _Watch:
    """The policy's answer now, from NVML's process list (read only when the mode looks at the card)."""

    def __init__(
        self, policy: YieldPolicy, users: GpuUsers, clock: Callable[[], float], local_time: Callable[[], datetime]
    ) -> None:
        self.policy, self.users, self.clock, self.local_time = policy, users, clock, local_time

    def reason(self) -> str | None:
        found = self.users.users() if self.policy.watches_gpu else []
        return self.policy.reason(found, own_pids() if found else set(), now=self.clock(), local_time=self.local_time())


class YieldControl:
    def __init__(
        self,
        policy: YieldPolicy,
        users: GpuUsers,
        node: WorkerNode,
        events: EventWriter,
        grace_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        local_time: Callable[[], datetime] = datetime.now,
    ) -> None:
        self._watch = _Watch(policy, users, clock, local_time)
        self.users, self.node, self.events, self.grace_s, self.clock = users, node, events, grace_s, clock
        self.energy = EnergyMeter()
        self.energy.read(users.energy_mj(), serving=False)  # the baseline: the worker serves from here on
        self._since = self._said_at = 0.0
        self._said = ""

    def tick(self) -> bool:
        """Yield or serve as the policy says now; False once the grace ran out (the caller then leaves the swarm)."""
        reason, now = self._watch.reason(), self.clock()
        if reason is None:
            if self.node.yielding:
                self._switch(serving=True)
                resumed = RESUMED_REASON if self._said == PAUSED_REASON else "the GPU is free again"
                self.events.emit(YieldEvent(state="resumed", reason=resumed))
            return True
        if not self.node.yielding:
            self._switch(serving=False)
            self._since, self._said = now, ""
        grace_left = max(0.0, self.grace_s - (now - self._since))
        if grace_left <= 0:
            self.events.emit(
                YieldEvent(
                    state="left",
                    reason=f"{reason}; yielded for {self.grace_s:.0f} s (--yield-grace), "
                    "so the slot is given back; the worker joins again once it may use the GPU",
                    grace_left_s=0.0,
                )
            )
            return False
        if reason != self._said or now - self._said_at >= REPORT_EVERY_S:
            self.events.emit(YieldEvent(state="yielding", reason=reason, grace_left_s=round(grace_left, 1)))
            self._said, self._said_at = reason, now
        return True

    def _switch(self, serving: bool) -> None:
        """Drain or serve; the energy counter is read at the switch, so that only serving time counts."""
        self.energy.read(self.users.energy_mj(), serving=not serving)
        self.node.resume() if serving else self.node.yield_gpu()

    def energy_event(self, points: float) -> EnergyEvent:
        """Energy used while serving so far, and ``points`` (the estimate since the worker started) per kWh."""
        self.energy.read(self.users.energy_mj(), serving=not self.node.yielding)
        kwh = self.energy.kwh
        return EnergyEvent(
            kwh=None if kwh is None else round(kwh, 6), points_per_kwh=self.energy.points_per_kwh(points)
        )


def wait_until_free(
    policy: YieldPolicy,
    users: GpuUsers,
    events: EventWriter,
    stop: threading.Event,
    *,
    clock: Callable[[], float] = time.monotonic,
    local_time: Callable[[], datetime] = datetime.now,
) -> bool:
    """Before a join: wait while the policy says yield, saying why; False when stopped first."""
    watch, said, said_at = _Watch(policy, users, clock, local_time), "", 0.0
    while not stop.is_set():
        reason = watch.reason()
        if reason is None:
            if said:  # the front ends stop showing the yield
                events.emit(YieldEvent(state="resumed", reason="the worker may use the GPU again: joining"))
            return True
        if reason != said or clock() - said_at >= REPORT_EVERY_S:
            events.emit(YieldEvent(state="yielding", reason=f"{reason}; the worker joins once it may use the GPU"))
            said, said_at = reason, clock()
        stop.wait(WAIT_TICK_S)
    return False
