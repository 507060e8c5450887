"""The event contract between the worker runtime and every front end.

The runtime writes one JSON object per line: ``{"v": 1, "ts": ..., "kind": "...", ...}``.
The TUI, the headless printer and the rotating JSONL log all read this one stream.
Changing what a field means requires bumping ``VERSION``.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import IO, Annotated, Any, Iterable, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

VERSION = 1

SyncPhase = Literal["sync1", "sync2", "active"]
Level = Literal["debug", "info", "warning", "error"]
# The preflight checks in the order the runtime runs them; reachability last: the swarm tests it during the join.
PreflightCheck = Literal["gpu", "host_ram", "disk", "download_rate", "upload_rate", "seed_rtt", "reachability"]
PREFLIGHT_CHECKS: tuple[PreflightCheck, ...] = get_args(PreflightCheck)
MACHINE_CHECKS: tuple[PreflightCheck, ...] = PREFLIGHT_CHECKS[:-1]  # the ones run before the join


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = VERSION
    ts: float = Field(default_factory=time.time)


class AuthEvent(_Event):
    kind: Literal["auth"] = "auth"
    status: Literal["authorizing", "authorized", "rejected", "failed"]
    identity: str | None = None
    stage: str | None = None
    peer_id: str | None = None
    slot: int | None = None
    message: str = ""


class DownloadEvent(_Event):
    kind: Literal["download"] = "download"
    status: Literal["started", "progress", "retry", "verified", "done", "failed"]
    file: str = ""
    bytes: int = 0
    total: int | None = None
    rate_bps: float = 0.0
    eta_s: float | None = None
    resumed_from: int = 0
    message: str = ""


class QueueEvent(_Event):
    kind: Literal["queue"] = "queue"
    position: int
    estimated_wait_s: float | None = None


class SyncEvent(_Event):
    kind: Literal["sync"] = "sync"
    phase: SyncPhase
    steps_left: int = 0
    steps_total: int = 0
    target_epoch: int | None = None
    local_epoch: int = 0
    message: str = ""


class StepEvent(_Event):
    kind: Literal["step"] = "step"
    stage: str
    local_epoch: int
    forward_per_min: float = 0.0
    backward_per_min: float = 0.0
    samples: int = 0
    loss: float | None = None
    stage_share: float | None = None  # this worker's share of the samples its stage processed in the epoch (0..1)


class SpartaEvent(_Event):
    kind: Literal["sparta"] = "sparta"
    round: int
    partition: int  # which slice of the stage's parameters the round averaged, numbered from 0
    group_size: int = 0
    fraction: float = 0.0  # share of that slice that came back averaged with at least one other peer (0..1)
    bytes_sent: int = 0
    bytes_received: int = 0
    duration_s: float = 0.0
    weight: float = 1.0
    ok: bool = True
    reason: str | None = None
    partitions: int = 0  # slices the stage's parameters are cut into (0: not said, a runtime from before this field)
    stage_share: float | None = None  # the slice's share of the stage's parameters (0..1); None: not said
    # relative L2 of this worker's slice from the group's average before / right after the update
    # (agora_client/averaging/drift.py); None: the round averaged nothing, or a runtime from before these fields
    drift_before: float | None = None
    drift_after: float | None = None


class TrafficEvent(_Event):
    """Requests this worker served and the bytes it moved, counted where they happen (its connection
    handlers and its SPARTA rounds). Rates are over the last ``window_s`` seconds."""

    kind: Literal["traffic"] = "traffic"
    forward_per_min: float = 0.0
    backward_per_min: float = 0.0
    upload_bps: float = 0.0
    download_bps: float = 0.0
    forward_total: int = 0
    backward_total: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    window_s: float = 0.0
    upload_cap_bps: float | None = None  # the contributor's upload cap (--max-upload-mbit) in bytes/s; None: no cap
    announced_uplink_bps: float | None = None  # the uplink it announces to its SPARTA groups: min(measured, cap)


class SpotCheckStatus(BaseModel):
    """The trainers' spot checks of one stage's workers, summed over the trainers that check it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    checks: int = 0
    strikes: int = 0
    bans: int = 0
    # where the less assured kind of request stands (forward, backward); a kind is judged if any trainer judges it
    state: Literal["calibrating", "verifiable", "unverifiable"] = "calibrating"


class StageSwarm(BaseModel):
    """One stage as a contributor can see it: its workers by phase (the DHT roster), its join queue and
    capacity (the auth service's public /v1/status), the trainers' spot checks on it (their progress records) and how
    far its replicas are apart (its workers' metrics records)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    stage: str
    active: int = 0  # healthy workers in sync (serving and averaging)
    syncing: int = 0  # healthy workers in sync phase 1 or 2
    unhealthy: int = 0  # workers whose outputs turned non-finite: they serve nothing until they have reloaded
    yielding: int = 0  # healthy workers that gave the GPU back to its owner for now: they keep a slot, serve nothing
    queued: int | None = None  # joiners waiting for the stage; None: the auth service did not answer
    capacity: int | None = None  # workers the stage takes; None: the auth service did not answer
    spot_checks: SpotCheckStatus | None = None  # None: no trainer spot-checks this stage
    # the stage's replica drift: the mean over its workers' signed metrics records of their latest SPARTA round's
    # drift before the update (agora_client/discovery/replica_drift.py); None: no worker has averaged yet
    drift: float | None = None


class SwarmEvent(_Event):
    """How the whole swarm is learning, from the trainers' progress records in the DHT, and how each stage
    stands. Events recorded before the per-stage view parse with ``stage`` empty and no ``stages``."""

    kind: Literal["swarm"] = "swarm"
    trainers: int = 0
    loss: float | None = None  # newest loss the trainers reported (mean over trainers)
    loss_history: list[tuple[float, float]] = Field(default_factory=list)  # (ts, loss), oldest first
    tokens_per_s: float = 0.0  # all trainers together
    eval_loss: float | None = None  # newest held-out eval loss (mean over the trainers that have evaluated)
    eval_history: list[tuple[float, float]] = Field(default_factory=list)  # (time of the eval, its loss), oldest first
    stage: str = ""  # this worker's stage
    stages: list[StageSwarm] = Field(default_factory=list)  # every stage of the run, in the run's order


class GpuInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int
    name: str
    memory_used: int
    memory_total: int
    utilization: float | None = None


class ResourcesEvent(_Event):
    kind: Literal["resources"] = "resources"
    gpu: GpuInfo | None = None
    gpu_note: str = ""
    process_rss: int = 0
    host_ram_used: int = 0
    host_ram_total: int = 0
    cpu_percent: float | None = None


class PointsEvent(_Event):
    kind: Literal["points"] = "points"
    presence: float
    compute: float
    rate_per_hour: float = 0.0
    confirmed: float | None = None
    rank: int | None = None  # place on the monitor's leaderboard (1 = first)
    ranked: int | None = None  # contributors on the leaderboard
    page_url: str | None = None  # this contributor's public page on the monitor
    # The monitor's view of this peer's compute: what it claimed, what trainers' receipts verified of it, and
    # whether the claim exceeds the receipts past the monitor's margin (None: no word from a monitor).
    claimed_compute: float | None = None
    verified_compute: float | None = None
    flagged: bool | None = None


class YieldEvent(_Event):
    """The worker gives the GPU back to its owner (``--yield``, ``--active-hours``): ``yielding`` while it does
    (drained: out of routing and SPARTA, its slot kept for ``grace_left_s`` more seconds), ``resumed`` when it
    serves again, ``left`` when the grace ran out and it gave its slot back (it joins again once the GPU is free)."""

    kind: Literal["yield"] = "yield"
    state: Literal["yielding", "resumed", "left"]
    reason: str = ""
    grace_left_s: float | None = None


class EnergyEvent(_Event):
    """Energy the GPU used while this worker served (NVML's counter, Volta and newer), and the estimated points
    earned per kWh; None where the card does not report energy."""

    kind: Literal["energy"] = "energy"
    kwh: float | None = None
    points_per_kwh: float | None = None


class StageEvent(_Event):
    kind: Literal["stage"] = "stage"
    stage: str
    peer_id: str = ""
    occupancy: dict[str, int] = Field(default_factory=dict)


class PreflightEvent(_Event):
    """One check before authorization: pass, warn or fail, with the measured value and the reason."""

    kind: Literal["preflight"] = "preflight"
    check: PreflightCheck
    status: Literal["pass", "warn", "fail"]
    value: str = ""
    reason: str = ""


class NetworkFinding(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    what: str
    action: str  # the one thing to do about it


class NetworkReport(BaseModel):
    """The client's diagnosis of the network between it and the swarm (empty text: not known)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    local_address: str = ""
    router_external: str = ""  # the router's own internet side, as it says over UPnP
    seen_address: str = ""  # where the swarm's auth service saw the join come from
    mapping: Literal["mapped", "refused", "not offered", "off"] = "off"
    mapping_detail: str = ""
    nat: bool = False
    carrier_grade_nat: bool = False
    double_nat: bool = False
    findings: list[NetworkFinding] = Field(default_factory=list)


class ReachabilityEvent(_Event):
    """The auth service's dial-back to the announced address; ``advice`` says what to open when it failed.

    ``path`` is how the swarm reaches the worker once it can: directly, through the router's port mapping,
    or through a relay (``relay`` names it, ``relay_cost`` says what that costs)."""

    kind: Literal["reachability"] = "reachability"
    status: Literal["checking", "reachable", "unreachable"]
    address: str = ""
    port: int | None = None
    tested_from: str = ""
    error: str = ""
    advice: list[str] = Field(default_factory=list)
    retry_in_s: float | None = None
    trying_relay: bool = False  # unreachable: the next try, at once, goes through the run's relay
    path: Literal["", "direct", "mapped", "relayed"] = ""
    relay: str = ""
    relay_cost: str = ""
    network: NetworkReport | None = None


class LogEvent(_Event):
    kind: Literal["log"] = "log"
    level: Level = "info"
    tag: str = "INFO"
    message: str


class ErrorEvent(_Event):
    kind: Literal["error"] = "error"
    message: str
    hint: str = ""
    where: str = ""


# ErrorEvent.where of a runtime that could not begin the join (no usable GPU, bad transport, no run description)
STARTING = "start-up"


class ExitEvent(_Event):
    kind: Literal["exit"] = "exit"
    code: int
    reason: str = ""


Event = Annotated[
    Union[
        AuthEvent,
        DownloadEvent,
        QueueEvent,
        SyncEvent,
        StepEvent,
        SpartaEvent,
        ResourcesEvent,
        PointsEvent,
        YieldEvent,
        EnergyEvent,
        StageEvent,
        TrafficEvent,
        SwarmEvent,
        PreflightEvent,
        ReachabilityEvent,
        LogEvent,
        ErrorEvent,
        ExitEvent,
    ],
    Field(discriminator="kind"),
]

_adapter: TypeAdapter[Event] = TypeAdapter(Event)


class BadEvent(ValueError):
    """A line that is not a valid event of this contract's version."""


def parse_event(line: str | bytes | dict[str, Any]) -> Event:
    """Parse one line (or decoded object) of the stream; raise BadEvent with the reason otherwise."""
    try:
        data = line if isinstance(line, dict) else json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadEvent(f"not JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadEvent("an event must be a JSON object")
    if data.get("v") != VERSION:
        raise BadEvent(f"event version {data.get('v')!r} is not {VERSION}")
    try:
        return _adapter.validate_python(data)
    except ValidationError as error:
        raise BadEvent(f"invalid {data.get('kind')!r} event: {error.errors()[0]['msg']}") from None


def json_objects(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The JSON objects among a stream's lines, unvalidated (log lines and a line still being written are skipped)."""
    found = []
    for line in lines:
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def dump_event(event: Event) -> str:
    return event.model_dump_json(exclude_none=False)


class EventWriter:
    """Writes events as JSON lines to any number of sinks; thread-safe; a broken sink is dropped, not fatal."""

    def __init__(self, *sinks: IO[str]):
        self._sinks = list(sinks)
        self._had_sinks = bool(sinks)
        self._lock = threading.Lock()
        # A helper forked while another thread held the lock would block on its first event (its log records
        # come here too): the child starts with a fresh lock.
        this = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _fresh_lock(this()))

    @property
    def broken(self) -> bool:
        """Every sink this writer had has failed (e.g. the app reading our stdout went away)."""
        return self._had_sinks and not self._sinks

    def add_sink(self, sink: IO[str]) -> None:
        with self._lock:
            self._sinks.append(sink)
            self._had_sinks = True

    def emit(self, event: Event) -> None:
        line = dump_event(event) + "\n"
        with self._lock:
            for sink in list(self._sinks):
                try:
                    sink.write(line)
                    sink.flush()
                except (OSError, ValueError):
                    self._sinks.remove(sink)

    def log(self, message: str, *, tag: str = "INFO", level: Level = "info") -> None:
        self.emit(LogEvent(tag=tag, level=level, message=message))


def _fresh_lock(writer: EventWriter | None) -> None:
    if writer is not None:
        writer._lock = threading.Lock()


NULL_WRITER = EventWriter()
