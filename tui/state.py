"""The join path as a state machine fed by events: which step is current, which one failed and why."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from agora_client.events import (
    AuthEvent, DownloadEvent, ErrorEvent, Event, LogEvent, QueueEvent, ReachabilityEvent, SyncEvent,
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
    JoinStep.AUTHORIZATION: "check your Hugging Face token (agora_cli.py --reconfigure) and the --swarm address, then restart",
    JoinStep.DOWNLOAD: "check your connection and free disk space; a restart resumes the download where it stopped",
    JoinStep.QUEUE: "restart to rejoin the queue; the downloaded snapshot is kept",
    JoinStep.SYNC1: "restart; if it keeps failing, export a support bundle (e) and open a ticket",
    JoinStep.SYNC2: "restart; if it keeps failing, export a support bundle (e) and open a ticket",
    JoinStep.ACTIVE: "restart; if it keeps failing, export a support bundle (e) and open a ticket",
}
REJECTED_ADVICE = "the swarm is full or this identity reached its cap: try again later"
JOIN_TAG = "JOIN"  # log events with this tag say what happens between two steps (starting the worker...)
_SYNC_STEPS = {"sync1": JoinStep.SYNC1, "sync2": JoinStep.SYNC2, "active": JoinStep.ACTIVE}


@dataclass(frozen=True)
class Failure:
    step: JoinStep
    reason: str
    advice: str


class JoinTracker:
    """Current step, failure and a one-line status. Steps only move forward, except that a sync
    event may send the worker back to phase 1 (it fell too far behind its stage)."""

    def __init__(self) -> None:
        self.step = JoinStep.AUTHORIZATION
        self.failure: Failure | None = None
        self.status = "Starting the worker runtime..."
        self.unreachable = False  # the swarm could not dial this worker back: r retries at once

    def _advance(self, step: JoinStep) -> None:
        if step > self.step:
            self.step = step
            self.failure = None

    def _fail(self, reason: str, advice: str = "") -> None:
        self.failure = Failure(self.step, reason, advice or ADVICE[self.step])

    def apply(self, event: Event) -> bool:
        """Update from one event; True when the stepper should be redrawn."""
        if isinstance(event, AuthEvent):
            if event.status == "authorizing":
                self.status = "Exchanging your Hugging Face token for a slot..."
            elif event.status == "authorized":
                self._advance(JoinStep.DOWNLOAD)
                self.status = f"Authorized as {event.identity or 'unknown'}, stage {event.stage or '?'}"
            else:
                self._fail(event.message or f"authorization {event.status}", REJECTED_ADVICE if event.status == "rejected" else "")
            return True
        if isinstance(event, DownloadEvent):
            before = self.step
            self._advance(JoinStep.DOWNLOAD)
            if event.status == "failed":
                self._fail(event.message or "the snapshot download failed")
                return True
            if event.status == "done" and self.step == JoinStep.DOWNLOAD:
                self.status = "Snapshot ready; waiting for the join queue's answer..."
                return True
            return before != self.step
        if isinstance(event, QueueEvent):
            self._advance(JoinStep.QUEUE)
            if event.position > 0:
                self.status = "Waiting in the join queue; the downloaded snapshot is kept"
            else:
                self.status = "Admitted: no wait in the join queue"
            return True
        if isinstance(event, LogEvent) and event.tag == JOIN_TAG:  # what the runtime does between the steps
            self.status = event.message
            return True
        if isinstance(event, SyncEvent):
            step = _SYNC_STEPS[event.phase]
            changed = step != self.step
            self.step, self.failure = step, None
            if changed or event.message:
                self.status = event.message.splitlines()[0] if event.message else LABELS[step]
            return True
        if isinstance(event, ReachabilityEvent):
            self.unreachable = event.status == "unreachable"
            if self.unreachable:
                self.status = f"The swarm cannot reach this worker at {event.address}: see the log for what to open; press r to retry now"
            return True
        if isinstance(event, ErrorEvent):
            self._fail(event.message, event.hint)
            return True
        return False

    def child_exited(self, code: int | None, reason: str, advice: str = "") -> None:
        """The runtime is gone: a nonzero exit fails the current step unless an error already did."""
        if code != 0 and self.failure is None:
            self._fail(reason, advice)
        self.status = "The worker runtime stopped"

    def restarted(self) -> None:
        self.__init__()
