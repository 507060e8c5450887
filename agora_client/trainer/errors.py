"""Classify what a failed worker RPC means for routing: retry there, move elsewhere, or stop.

The rules follow what hivemind actually raises (observed against real p2pd peers):
- the remote handler raised: ``P2PHandlerError`` whose text is ``repr(exc)`` (unary calls) or
  ``"Failed to call handler `name` at <peer>: <str(exc)>"`` (streams);
- the daemon could not reach the peer: ``P2PDaemonError`` / ``ControlFailure``, read by
  agora_client/engine/libp2p_errors.py (dial failures, a peer gone mid-call or no longer serving);
- the peer died mid-stream: the reply stream just ends, which ``asingle`` turns into a ValueError,
  and code reading tensors directly should raise ``WorkerVanishedError``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

from hivemind.p2p import P2PDaemonError, P2PHandlerError

from agora_client.engine.libp2p_errors import DaemonFailure, daemon_failure, says_timeout, stream_ended_empty


class ErrorClass(str, Enum):
    RETRY_SAME = "retry_same"  # transient (timeout): the same worker may well answer next time
    RETRY_OTHER = "retry_other"  # the worker is unreachable or broken: ban it, send the request elsewhere
    FATAL = "fatal"  # our bug or a request the worker rejected: retrying the same input cannot help


class WorkerVanishedError(ConnectionError):
    """A worker's reply ended without an answer (its stream closed: the peer died mid-call)."""


# the worker raised, but for reasons of its own state, not because of our input
_WORKER_SIDE_HINTS = (
    "out of memory",
    "cuda error",
    "keyerror",  # the uid is not served there (any more)
    "sync phase",
    "not ready",
    "shutting down",
    "after shutdown",  # "cannot schedule new futures after shutdown": the worker is stopping
    "event loop is closed",
    "cancellederror",
    "brokenpipeerror",
    "eoferror",
    "connectionerror",
    "connectionreseterror",
)
_ROUTE_ON_DAEMON_FAILURE = {
    DaemonFailure.OWN_LIMIT: ErrorClass.FATAL,
    DaemonFailure.UNREACHABLE: ErrorClass.RETRY_OTHER,
    DaemonFailure.TIMEOUT: ErrorClass.RETRY_SAME,
    # the daemon could not deliver to that peer for a reason we do not know
    DaemonFailure.OTHER: ErrorClass.RETRY_OTHER,
}


def classify(error: BaseException) -> ErrorClass:
    """Map an exception raised by a worker RPC to what the router should do about it."""
    if isinstance(error, P2PHandlerError):
        return _classify_remote(str(error).lower())
    if isinstance(error, P2PDaemonError):
        return _ROUTE_ON_DAEMON_FAILURE[daemon_failure(error)]
    if isinstance(error, TimeoutError):  # asyncio.TimeoutError and concurrent.futures.TimeoutError alias it
        return ErrorClass.RETRY_SAME
    if isinstance(error, (ConnectionError, asyncio.IncompleteReadError, EOFError)):
        return ErrorClass.RETRY_OTHER
    if stream_ended_empty(error):
        return ErrorClass.RETRY_OTHER
    if isinstance(error, OSError):
        return ErrorClass.RETRY_SAME
    if error.__cause__ is not None:  # a wrapper raised `from` the real failure
        return classify(error.__cause__)
    return ErrorClass.FATAL


def _classify_remote(text: str) -> ErrorClass:
    if any(hint in text for hint in _WORKER_SIDE_HINTS):
        return ErrorClass.RETRY_OTHER
    if says_timeout(text):
        return ErrorClass.RETRY_SAME
    return ErrorClass.FATAL  # shape / dtype / validation error: the worker rejected this input


@dataclass(frozen=True)
class RetryPolicy:
    """How often one request (one microbatch at one stage) is tried before it is given up."""

    max_attempts: int = 4
    max_same_worker: int = 2  # attempts on one worker before a transient error moves the request elsewhere

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_same_worker < 1:
            raise ValueError("RetryPolicy needs max_attempts >= 1 and max_same_worker >= 1")

    def next_step(self, error_class: ErrorClass, attempts: int, attempts_on_worker: int) -> ErrorClass | None:
        """After a failed attempt: RETRY_SAME, RETRY_OTHER, or None to give the request up."""
        if error_class is ErrorClass.FATAL or attempts >= self.max_attempts:
            return None
        if error_class is ErrorClass.RETRY_SAME and attempts_on_worker < self.max_same_worker:
            return ErrorClass.RETRY_SAME
        return ErrorClass.RETRY_OTHER


DEFAULT_RETRY = RetryPolicy()
