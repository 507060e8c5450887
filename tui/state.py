"""The join path as a state machine fed by events: which step is current, which one failed and why;
and the preflight before it: each check's result and, while the swarm cannot reach this worker, the diagnosis."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from agora_client.events import (
    MACHINE_CHECKS,  # the machine's preflight checks, in the order the runtime runs them
    STARTING,
    AuthEvent,
    DownloadEvent,
    ErrorEvent,
    Event,
    LogEvent,
    PreflightEvent,
    QueueEvent,
    ReachabilityEvent,
    SyncEvent,
    YieldEvent,
)


class JoinStep(IntEnum):
    AUTHORIZATION = 0
    DOWNLOAD = 1
    QUEUE = 2
    SYNC1 = 3
    SYNC2 = 4
    ACTIVE = 5


LABELS = {
    JoinStep.AUTHORIZATION: "Authorization",
    JoinStep.DOWNLOAD: "Download",
    JoinStep.QUEUE: "Queue",
    JoinStep.SYNC1: "Sync 1",
    JoinStep.SYNC2: "Sync 2",
    JoinStep.ACTIVE: "Active",
}
# What to do when a step fails and the runtime gave no hint.
ADVICE = {
    JoinStep.AUTHORIZATION: (
        "check your Hugging Face token (agora_cli.py --reconfigure) and the --swarm address, then restart"
    ),
    JoinStep.DOWNLOAD: "check your connection and free disk space; a restart resumes the download where it stopped",
    JoinStep.QUEUE: "restart to rejoin the queue; the downloaded snapshot is kept",
    JoinStep.SYNC1: "restart; if it keeps failing, export a support bundle (e) and open a ticket",
    JoinStep.SYNC2: "restart; if it keeps failing, export a support bundle (e) and open a ticket",
    JoinStep.ACTIVE: "restart; if it keeps failing, export a support bundle (e) and open a ticket",
}
REJECTED_ADVICE = "the swarm is full or this identity reached its cap: try again later"
START_ADVICE = "fix what the message says, then restart; export a support bundle (e) if it is unclear"
PREFLIGHT_ADVICE = "fix what the failed preflight check says (see the Preflight panel), then restart (r)"
JOIN_TAG = "JOIN"  # log events with this tag say what happens between two steps (starting the worker...)
_SYNC_STEPS = {"sync1": JoinStep.SYNC1, "sync2": JoinStep.SYNC2, "active": JoinStep.ACTIVE}

CHECK_LABELS = {
    "gpu": "GPU",
    "host_ram": "Host RAM",
    "disk": "Free disk",
    "download_rate": "Download rate",
    "upload_rate": "Upload rate",
    "seed_rtt": "Round trip",
    "reachability": "Reachability",
}


class PreflightState:
    """What the preflight found: one result per check, and the latest dial-back by the swarm."""

    def __init__(self) -> None:
        self.results: dict[str, PreflightEvent] = {}
        self.reachability: ReachabilityEvent | None = None  # the latest reachability event
        self.diagnosis: ReachabilityEvent | None = None  # the latest failed dial-back, kept while a retry runs
        self.retry_requested = False  # r was pressed: the runtime was asked to dial again now
        self.failed_dials = 0  # dial-backs that failed since the runtime started

    def apply(self, event: Event) -> bool:
        if isinstance(event, PreflightEvent):
            self.results[event.check] = event
            return True
        if isinstance(event, ReachabilityEvent):
            self.reachability = event
            if event.status == "unreachable":
                self.diagnosis, self.retry_requested = event, False
                self.failed_dials += 1
            elif event.status == "reachable":
                self.diagnosis, self.retry_requested = None, False
            return True
        return False

    @property
    def seen(self) -> bool:
        return bool(self.results) or self.reachability is not None

    @property
    def unreachable(self) -> bool:
        """The swarm could not dial this worker back and the runtime has not been reached since."""
        return self.diagnosis is not None

    @property
    def checking(self) -> str | None:
        """The check running now: the first machine check without a result, or the dial-back."""
        for check in MACHINE_CHECKS:
            if check not in self.results:
                return check
        reachability = self.reachability
        if reachability is not None and reachability.status == "checking":
            return "reachability"
        return None

    @property
    def machine_done(self) -> int:
        return sum(check in self.results for check in MACHINE_CHECKS)

    def counts(self) -> dict[str, int]:
        counts = {"pass": 0, "warn": 0, "fail": 0}
        for result in self.results.values():
            counts[result.status] += 1
        return counts

    def failed(self) -> list[PreflightEvent]:
        return [result for check, result in self.results.items() if result.status == "fail" and check != "reachability"]


@dataclass(frozen=True)
class Failure:
    step: JoinStep | None  # None: the runtime failed before the join began (no step was tried)
    reason: str
    advice: str


class JoinTracker:
    """Current step, failure and a one-line status. Steps only move forward, except that a sync
    event may send the worker back to phase 1 (it fell too far behind its stage)."""

    def __init__(self) -> None:
        self.step = JoinStep.AUTHORIZATION
        self.failure: Failure | None = None
        self.status = "Starting the worker runtime..."
        self.preflight = PreflightState()
        self.authorized = False  # the swarm gave this worker a slot (the preflight view gives way)

    @property
    def unreachable(self) -> bool:
        """The swarm could not dial this worker back: r retries at once."""
        return self.preflight.unreachable

    @property
    def in_preflight(self) -> bool:
        """Before authorization, once the runtime reported a check: the preflight view is what to show."""
        return self.preflight.seen and not self.authorized and self.step == JoinStep.AUTHORIZATION

    def retry_now(self) -> None:
        self.preflight.retry_requested = True
        self.status = "Retrying now: asking the swarm to connect back to this worker..."

    def _advance(self, step: JoinStep) -> None:
        if step > self.step:
            self.step = step
            self.failure = None

    def _fail(self, reason: str, advice: str = "") -> None:
        self.failure = Failure(self.step, reason, advice or ADVICE[self.step])

    def apply(self, event: Event) -> bool:
        """Update from one event; True when the stepper should be redrawn."""
        match event:
            case AuthEvent():
                return self._on_auth(event)
            case DownloadEvent():
                return self._on_download(event)
            case QueueEvent():
                return self._on_queue(event)
            case LogEvent(tag=tag) if tag == JOIN_TAG:  # what the runtime does between the steps
                return self._on_join_log(event)
            case SyncEvent():
                return self._on_sync(event)
            case PreflightEvent():
                return self._on_preflight(event)
            case ReachabilityEvent():
                return self._on_reachability(event)
            case ErrorEvent():
                return self._on_error(event)
            case YieldEvent():
                return self._on_yield(event)
        return False

    def _on_yield(self, event: YieldEvent) -> bool:
        """The headline says why the worker does not serve (a pause, the GPU's owner, the hours), and when it serves
        again."""
        said = {"yielding": "Yielding the GPU", "resumed": "Serving again", "left": "Left the swarm"}[event.state]
        status = f"{said}: {event.reason}" if event.reason else said
        changed, self.status = status != self.status, status
        return changed

    def _on_auth(self, event: AuthEvent) -> bool:
        if event.status == "authorizing":
            dialing = self.preflight.reachability is not None and self.preflight.reachability.status == "checking"
            self.status = "Exchanging your Hugging Face token for a slot" + (
                "; the swarm is connecting back to this worker..." if dialing else "..."
            )
        elif event.status == "authorized":
            self.authorized = True
            self._advance(JoinStep.DOWNLOAD)
            self.status = f"Authorized as {event.identity or 'unknown'}, stage {event.stage or '?'}"
        else:
            self._fail(
                event.message or f"authorization {event.status}", REJECTED_ADVICE if event.status == "rejected" else ""
            )
        return True

    def _on_download(self, event: DownloadEvent) -> bool:
        """Progress alone redraws only when it moves the step."""
        before = self.step
        self._advance(JoinStep.DOWNLOAD)
        if event.status == "failed":
            self._fail(event.message or "the snapshot download failed")
            return True
        if event.status == "done" and self.step == JoinStep.DOWNLOAD:
            self.status = "Snapshot ready; waiting for the join queue's answer..."
            return True
        return before != self.step

    def _on_queue(self, event: QueueEvent) -> bool:
        self._advance(JoinStep.QUEUE)
        if event.position > 0:
            self.status = "Waiting in the join queue; the downloaded snapshot is kept"
        else:
            self.status = "Admitted: no wait in the join queue"
        return True

    def _on_join_log(self, event: LogEvent) -> bool:
        self.status = event.message
        return True

    def _on_sync(self, event: SyncEvent) -> bool:
        """A sync phase sets the step, forward or back to phase 1."""
        step = _SYNC_STEPS[event.phase]
        changed = step != self.step
        self.step, self.failure = step, None
        if changed or event.message:
            self.status = event.message.splitlines()[0] if event.message else LABELS[step]
        return True

    def _on_preflight(self, event: PreflightEvent) -> bool:
        self.preflight.apply(event)
        if event.check != "reachability":
            done = self.preflight.machine_done
            self.status = (
                f"Preflight: checking this machine and its network ({done} of {len(MACHINE_CHECKS)} checks done)..."
            )
            if done == len(MACHINE_CHECKS):
                self.status = "Preflight done: opening the worker's port..."
        return True

    def _on_reachability(self, event: ReachabilityEvent) -> bool:
        self.preflight.apply(event)
        where = event.address or (f"port {event.port}" if event.port is not None else "its port")
        if event.status == "checking":
            self.status = f"Asking the swarm to connect back to this worker ({where})..."
        elif event.status == "unreachable" and event.trying_relay:
            self.status = f"Not reachable at {where}: trying the run's relay..."
        elif event.status == "unreachable":
            self.status = f"Not reachable at {where}: open the port (see below); r retries now"
        elif not self.authorized:  # once authorized, the auth line says more
            self.status = f"The swarm reached this worker at {where}"
        return True

    def _on_error(self, event: ErrorEvent) -> bool:
        """Fail the current step, or the start where the runtime could not begin the join; without a hint, advise
        fixing a failed preflight check if one failed before authorization."""
        if event.where == STARTING:
            self.failure = Failure(None, event.message, event.hint or START_ADVICE)
            return True
        preflight_failed = self.step == JoinStep.AUTHORIZATION and not self.authorized and self.preflight.failed()
        self._fail(event.message, event.hint or (PREFLIGHT_ADVICE if preflight_failed else ""))
        return True

    def child_exited(self, code: int | None, reason: str, advice: str = "") -> None:
        """The runtime is gone: a nonzero exit fails the current step unless an error already did."""
        if code != 0 and self.failure is None:
            self._fail(reason, advice)
        self.status = "The worker runtime stopped"

    def restarted(self) -> None:
        self.__init__()
