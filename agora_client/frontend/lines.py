"""Tagged lines from the runtime's stream: what the headless client prints and the app's log pane shows.

Tags: ``[PREFLIGHT] [REACHABILITY] [NETWORK] [AUTH] [DOWNLOAD] [QUEUE] [SYNC] [TRAINING] [PROGRESS] [SPARTA]
[POINTS] [YIELD] [RESTART] [WARNING] [ERROR]``
(``[RESTART]``: the front end's own line before it starts a crashed runtime again, see frontend/restart.py).
What each event kind gives:

- preflight: ``[PREFLIGHT] <check>: PASS|WARN|FAIL <value> (<reason>)``; warn and fail at levels warning / error.
- reachability: ``[REACHABILITY]`` when the dial-back starts and when it succeeds (by which path); unreachable:
  one ``[REACHABILITY]`` line per line of advice (level error), the network's diagnosis in one line, then when
  the next attempt comes.
- auth: ``[AUTH]`` its message (or who / which stage / which slot); rejected or failed: ``[ERROR]``.
- download: ``[DOWNLOAD]`` start (with resumed-from), progress at most once per second of event
  time, verified, done; retry: ``[WARNING]``; failed: ``[ERROR]``.
- queue: ``[QUEUE] Authorization queue: position N, estimated wait: W``.
- sync: ``[SYNC] <line>`` for each line of the event's message, exactly as the runtime wrote it.
- step: ``[TRAINING]`` when the local epoch changes; ``[PROGRESS]`` requests per minute, at most
  once per 60 s of event time.
- sparta: ``[SPARTA]`` each round: which partition of how many (numbered from 0) and its share of the stage's
  parameters, e.g. ``partition 10 of 20 (5% of the stage)`` (failed rounds at level warning); points: ``[POINTS]`` at
  most once per 60 s, with the monitor's verified compute of the claimed once it has them; stage: ``[TRAINING]`` when
  the stage, peer or occupancy changes.
- yield: ``[YIELD]`` when the worker starts yielding the GPU to its owner (and why), when the reason changes, when
  it serves again, and when it gave its slot back after the grace (level warning); energy: ``[POINTS]`` the kWh
  used while serving and the points per kWh, at most once per 60 s, where the card reports energy.
- log: ``[<its tag>]``, or ``[WARNING]`` / ``[ERROR]`` by level; debug is not printed.
- error: ``[ERROR]`` message, then ``[ERROR] What to do: <hint>``; exit: ``[ERROR]`` when nonzero
  and no error event said why already.
- traffic: with an upload cap (``--max-upload-mbit``), ``[PROGRESS] Uploading X Mbit/s of the N Mbit/s cap`` and the
  uplink it announces to its averaging groups, at most once per 60 s; without one, not printed.
- resources, swarm: not printed (the app draws them; the JSONL log keeps them).
- a line that is not a valid event: ``[WARNING] Ignored a malformed line from the runtime: ...``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from agora_client.events import (
    AuthEvent,
    DownloadEvent,
    EnergyEvent,
    ErrorEvent,
    Event,
    ExitEvent,
    LogEvent,
    NetworkReport,
    PointsEvent,
    PreflightEvent,
    QueueEvent,
    ReachabilityEvent,
    SpartaEvent,
    StageEvent,
    StepEvent,
    SyncEvent,
    TrafficEvent,
    YieldEvent,
)
from agora_client.system.redact import redact_text

TAGS = (
    "PREFLIGHT",
    "REACHABILITY",
    "AUTH",
    "DOWNLOAD",
    "QUEUE",
    "SYNC",
    "TRAINING",
    "PROGRESS",
    "SPARTA",
    "POINTS",
    "YIELD",
    "RESTART",
    "WARNING",
    "ERROR",
)
_TAG_CHARS = re.compile(r"[^A-Z0-9_]")
_RAW_PREVIEW = 120


def human_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def mbit_text(bytes_per_s: float) -> str:
    """A rate in bytes/s as Mbit/s, the unit of internet plans and of --max-upload-mbit: "7.5 Mbit/s"."""
    mbit = bytes_per_s * 8 / 1e6
    return f"{mbit:.0f} Mbit/s" if mbit >= 100 else f"{mbit:.3g} Mbit/s"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, rest = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m" if rest == 0 else f"{minutes}m {rest:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def percent(share: float) -> str:
    """A share (0..1) as a percentage of three significant digits at most: 5%, 1.56%, 12.5%, 100%."""
    return f"{share * 100:.3g}%"


def averaged_text(event: SpartaEvent) -> str:
    """What a SPARTA round averaged, as a share of the stage: "partition 10 of 20 (5% of the stage)"; a round whose
    slice came back only in part says how much of it: "80% of partition 10 of 20 (4% of the stage)"; a round that
    measured its drift from the group's average says it before and after the update: "(5% of the stage; drift
    3.12% -> 0.02%)"."""
    what = f"partition {event.partition}" + (f" of {event.partitions}" if event.partitions else "")
    if event.fraction < 1:
        what = f"{percent(event.fraction)} of {what}"
    notes = [] if event.stage_share is None else [f"{percent(event.fraction * event.stage_share)} of the stage"]
    if event.drift_before is not None and event.drift_after is not None:  # None: a runtime from before drift
        notes.append(f"drift {drift_percent(event.drift_before)} -> {drift_percent(event.drift_after)}")
    return f"{what} ({'; '.join(notes)})" if notes else what


def drift_percent(drift: float) -> str:
    """A replica drift (relative L2) as a percentage: "3.12%"; one under 0.01% as "<0.01%"."""
    return "<0.01%" if 0 < drift < 1e-4 else percent(drift)


def verified_text(event: PointsEvent) -> str:
    """The monitor's verified compute beside the claimed, and its warning when the claim exceeds the receipts."""
    if event.verified_compute is None or event.claimed_compute is None:
        return ""
    text = f"; compute verified {event.verified_compute:.1f} of {event.claimed_compute:.1f} claimed"
    if event.flagged:
        text += " (the claim exceeds the trainers' receipts: only receipted compute earns points)"
    return text


def short_peer_id(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 14 else f"{peer_id[:6]}…{peer_id[-6:]}"


def occupancy_text(occupancy: dict[str, int]) -> str:
    return ", ".join(f"{stage} {count}" for stage, count in occupancy.items())


@dataclass(frozen=True)
class TaggedLine:
    """One human line derived from the stream; the app's log pane shows the same lines."""

    ts: float
    tag: str
    level: str
    text: str
    event: Event | None = None

    def render(self) -> str:
        return f"[{self.tag}] {self.text}"

    def render_json(self) -> str:
        record: dict[str, Any] = {"ts": self.ts, "tag": self.tag, "level": self.level, "message": self.text}
        record["event"] = self.event.model_dump(mode="json") if self.event is not None else None
        return json.dumps(record, ensure_ascii=False)


class LineFormatter:
    """Turns events into tagged lines. High-rate kinds are throttled by event time, so the
    output for a recorded stream is the same on every run."""

    def __init__(
        self, progress_interval_s: float = 1.0, summary_interval_s: float = 60.0, epoch_interval_s: float = 10.0
    ) -> None:
        self.progress_interval_s = progress_interval_s
        self.summary_interval_s = summary_interval_s
        self.epoch_interval_s = epoch_interval_s  # small swarms step every second or two
        self._last_download: dict[str, float] = {}
        self._last_progress: float | None = None
        self._last_points: float | None = None
        self._last_energy: float | None = None
        self._last_upload: float | None = None
        self._yield_said: tuple[str, str] | None = None  # (state, reason) of the last [YIELD] line
        self._epoch: int | None = None
        self._last_epoch_line: float | None = None
        self._stage: tuple[str, str, tuple] | None = None
        self._said_error = False  # an exit code needs no line of its own once an error said why

    def fresh(self) -> "LineFormatter":
        """A formatter with the same intervals and nothing seen yet, for the next run of the runtime."""
        return LineFormatter(self.progress_interval_s, self.summary_interval_s, self.epoch_interval_s)

    def _line(self, event: Event, tag: str, text: str, level: str = "info") -> TaggedLine:
        return TaggedLine(event.ts, tag, level, text, event)

    def format(self, event: Event) -> list[TaggedLine]:
        handler = getattr(self, f"_{event.kind}", None)
        lines = handler(event) if handler else []
        self._said_error = self._said_error or any(line.level == "error" for line in lines)
        return lines

    def malformed(self, reason: str, raw: str, ts: float) -> TaggedLine:
        preview = redact_text(raw.strip())[:_RAW_PREVIEW]
        return TaggedLine(ts, "WARNING", "warning", f"Ignored a malformed line from the runtime ({reason}): {preview}")

    def stderr(self, text: str, ts: float) -> TaggedLine:
        """A stderr line the stream reader already redacted (and folded, if it was a traceback)."""
        return TaggedLine(ts, "STDERR", "warning", text.rstrip())

    def note(self, text: str, ts: float, tag: str = "INFO", level: str = "info") -> TaggedLine:
        """A line the front end says itself (starting, stopping), not one from the runtime."""
        return TaggedLine(ts, tag, level, text)

    def _preflight(self, event: PreflightEvent) -> list[TaggedLine]:
        level = {"pass": "info", "warn": "warning", "fail": "error"}[event.status]
        reason = f" ({event.reason})" if event.reason else ""
        return [self._line(event, "PREFLIGHT", f"{event.check}: {event.status.upper()} {event.value}{reason}", level)]

    def _reachability(self, event: ReachabilityEvent) -> list[TaggedLine]:
        if event.status == "checking":
            where = event.address or f"port {event.port}"
            return [self._line(event, "REACHABILITY", f"Asking the swarm to connect back to {where}...")]
        if event.status == "reachable":
            how = PATHS.get(event.path, "")
            if event.path == "relayed":
                how = f", through the relay {event.relay}: {event.relay_cost}"
            return [
                self._line(
                    event,
                    "REACHABILITY",
                    f"The swarm reached this worker at {event.address} from {event.tested_from}{how}",
                )
            ]
        lines = [self._line(event, "REACHABILITY", text, "error") for text in event.advice]
        if event.network is not None:
            lines.append(self._line(event, "REACHABILITY", f"Network: {network_summary(event.network)}", "warning"))
        if event.trying_relay:
            text = "Not reachable directly; trying the run's relay now"
            lines.append(self._line(event, "REACHABILITY", text, "warning"))
        elif event.retry_in_s is not None:
            text = f"Not joining while unreachable; trying again in {human_duration(event.retry_in_s)}"
            lines.append(self._line(event, "REACHABILITY", text, "warning"))
        return lines

    def _auth(self, event: AuthEvent) -> list[TaggedLine]:
        if event.status == "authorizing":
            return [self._line(event, "AUTH", event.message or "Authorizing with the swarm...")]
        if event.status == "authorized":
            default = (
                f"Authorized as {event.identity or 'unknown'}: stage {event.stage or '?'}, slot "
                f"{event.slot if event.slot is not None else '?'}"
            )
            return [self._line(event, "AUTH", event.message or default)]
        what = "rejected by the swarm" if event.status == "rejected" else "failed"
        return [self._line(event, "ERROR", f"Authorization {what}: {event.message or 'no reason given'}", "error")]

    def _download(self, event: DownloadEvent) -> list[TaggedLine]:
        name = event.file or "snapshot"
        if event.status == "started":
            total = f" ({human_bytes(event.total)})" if event.total else ""
            resumed = f", resuming from {human_bytes(event.resumed_from)}" if event.resumed_from else ""
            self._last_download[name] = event.ts
            return [self._line(event, "DOWNLOAD", event.message or f"Downloading {name}{total}{resumed}")]
        if event.status == "progress":
            last = self._last_download.get(name)
            if last is not None and event.ts - last < self.progress_interval_s:
                return []
            self._last_download[name] = event.ts
            done = human_bytes(event.bytes)
            share = f"/{human_bytes(event.total)} ({event.bytes / event.total:.0%})" if event.total else ""
            eta = f", ETA {human_duration(event.eta_s)}" if event.eta_s is not None else ""
            return [self._line(event, "DOWNLOAD", f"{name}: {done}{share} at {human_bytes(event.rate_bps)}/s{eta}")]
        if event.status == "retry":
            why = f" ({event.message})" if event.message else ""
            text = f"Download of {name} interrupted{why}; resuming from {human_bytes(event.bytes)}"
            return [self._line(event, "WARNING", text, "warning")]
        if event.status == "verified":
            return [self._line(event, "DOWNLOAD", event.message or f"{name} verified")]
        if event.status == "done":
            size = f" ({human_bytes(event.bytes)})" if event.bytes else ""
            return [self._line(event, "DOWNLOAD", event.message or f"Snapshot downloaded{size}")]
        return [self._line(event, "ERROR", f"Download of {name} failed: {event.message or 'no reason given'}", "error")]

    def _queue(self, event: QueueEvent) -> list[TaggedLine]:
        if event.position <= 0:
            return [self._line(event, "QUEUE", "Left the join queue")]
        text = (
            f"Authorization queue: position {event.position}, estimated wait: {human_duration(event.estimated_wait_s)}"
        )
        return [self._line(event, "QUEUE", text)]

    def _sync(self, event: SyncEvent) -> list[TaggedLine]:
        return [self._line(event, "SYNC", line) for line in event.message.splitlines() if line.strip()]

    def _step(self, event: StepEvent) -> list[TaggedLine]:
        lines = []
        epoch_due = self._last_epoch_line is None or event.ts - self._last_epoch_line >= self.epoch_interval_s
        if event.local_epoch != self._epoch and epoch_due:
            self._epoch, self._last_epoch_line = event.local_epoch, event.ts
            loss = f", loss {event.loss:.4f}" if event.loss is not None else ""
            lines.append(self._line(event, "TRAINING", f"Local epoch {event.local_epoch} on stage {event.stage}{loss}"))
        if self._last_progress is None or event.ts - self._last_progress >= self.summary_interval_s:
            self._last_progress = event.ts
            text = (
                f"Serving {event.forward_per_min:.0f} forward and {event.backward_per_min:.0f} backward requests "
                "per minute"
            )
            lines.append(self._line(event, "PROGRESS", text))
        return lines

    def _sparta(self, event: SpartaEvent) -> list[TaggedLine]:
        if not event.ok:
            return [
                self._line(
                    event, "SPARTA", f"Round {event.round} failed: {event.reason or 'no reason given'}", "warning"
                )
            ]
        text = (
            f"Round {event.round}: averaged {averaged_text(event)} in a group of {event.group_size} in "
            f"{event.duration_s:.1f}s"
        )
        return [self._line(event, "SPARTA", text)]

    def _traffic(self, event: TrafficEvent) -> list[TaggedLine]:
        if event.upload_cap_bps is None:
            return []
        if self._last_upload is not None and event.ts - self._last_upload < self.summary_interval_s:
            return []
        self._last_upload = event.ts
        text = f"Uploading {mbit_text(event.upload_bps)} of the {mbit_text(event.upload_cap_bps)} cap"
        if event.announced_uplink_bps is not None:
            text += f"; announcing {mbit_text(event.announced_uplink_bps)} to averaging groups"
        return [self._line(event, "PROGRESS", text)]

    def _points(self, event: PointsEvent) -> list[TaggedLine]:
        if self._last_points is not None and event.ts - self._last_points < self.summary_interval_s:
            return []
        self._last_points = event.ts
        confirmed = f", confirmed {event.confirmed:.1f}" if event.confirmed is not None else ""
        text = (
            f"Presence {event.presence:.1f}, compute {event.compute:.1f}, {event.rate_per_hour:.1f} per hour{confirmed}"
        )
        return [self._line(event, "POINTS", text + verified_text(event))]

    def _energy(self, event: EnergyEvent) -> list[TaggedLine]:
        if event.kwh is None or (
            self._last_energy is not None and event.ts - self._last_energy < self.summary_interval_s
        ):
            return []
        self._last_energy = event.ts
        per_kwh = f", {event.points_per_kwh:,.0f} points per kWh" if event.points_per_kwh is not None else ""
        return [self._line(event, "POINTS", f"Energy used while serving: {event.kwh:.3f} kWh{per_kwh}")]

    def _yield(self, event: YieldEvent) -> list[TaggedLine]:
        """A line per change of state or reason, not per countdown of the grace."""
        if self._yield_said == (event.state, event.reason):
            return []
        self._yield_said = (event.state, event.reason)
        if event.state == "resumed":
            return [self._line(event, "YIELD", f"Serving again: {event.reason}")]
        if event.state == "left":
            return [self._line(event, "YIELD", f"Left the swarm: {event.reason}", "warning")]
        grace = (
            f" (the slot is kept for {human_duration(event.grace_left_s)} more)"
            if event.grace_left_s is not None
            else ""
        )
        return [self._line(event, "YIELD", f"Yielding the GPU: {event.reason}{grace}")]

    def _stage(self, event: StageEvent) -> list[TaggedLine]:
        key = (event.stage, event.peer_id, tuple(sorted(event.occupancy.items())))
        if key == self._stage:
            return []
        self._stage = key
        peer = f" as peer {short_peer_id(event.peer_id)}" if event.peer_id else ""
        occupancy = f"; stage occupancy: {occupancy_text(event.occupancy)}" if event.occupancy else ""
        return [self._line(event, "TRAINING", f"Serving stage {event.stage}{peer}{occupancy}")]

    def _log(self, event: LogEvent) -> list[TaggedLine]:
        if event.level == "debug":
            return []
        if event.level in ("warning", "error"):
            tag = event.level.upper()
        else:
            tag = _TAG_CHARS.sub("", event.tag.upper()) or "INFO"
        return [self._line(event, tag, event.message, event.level)]

    def _error(self, event: ErrorEvent) -> list[TaggedLine]:
        where = f" (in {event.where})" if event.where else ""
        lines = [self._line(event, "ERROR", f"{event.message}{where}", "error")]
        if event.hint:
            lines.append(self._line(event, "ERROR", f"What to do: {event.hint}", "error"))
        return lines

    def _exit(self, event: ExitEvent) -> list[TaggedLine]:
        if event.code == 0 or self._said_error:
            return []
        reason = f": {event.reason}" if event.reason else ""
        return [self._line(event, "ERROR", f"The runtime exited with code {event.code}{reason}", "error")]


MAPPING = {  # the router's answer to the port mapping request, in words
    "mapped": "your router forwards the port",
    "refused": "your router refused to forward the port",
    "not offered": "no router offered port mapping (UPnP or NAT-PMP)",
    "off": "port mapping off",
}


PATHS = {"direct": ", directly", "mapped": ", through your router's port mapping"}  # how the swarm reaches the worker


def network_summary(network: NetworkReport | None) -> str:
    """One line: which NAT stands between this machine and the swarm, and what the router said."""
    if network is None:
        return "not diagnosed"
    if network.carrier_grade_nat:
        nat = "carrier-grade NAT (your provider's)"
    elif network.double_nat:
        nat = "double NAT (two routers)"
    elif network.nat:
        nat = f"behind NAT: {network.local_address} is seen as {network.seen_address}"
    else:
        nat = f"no NAT seen ({network.local_address or 'address unknown'})"
    return f"{nat} · {MAPPING[network.mapping]}"
