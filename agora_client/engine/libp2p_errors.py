"""What a failed call through hivemind's p2p daemon means, read from its text.

hivemind raises P2PDaemonError with go-libp2p's message and nothing else (no code), and
``hivemind.utils.asyncio.asingle`` a plain ValueError when a reply stream ends empty; routing must
read the text. The texts below were observed against real p2pd peers.
"""

from __future__ import annotations

from enum import Enum

from hivemind.p2p import P2PDaemonError

__all__ = ["DaemonFailure", "daemon_failure", "says_timeout", "stream_ended_empty"]


class DaemonFailure(str, Enum):
    OWN_LIMIT = "own_limit"  # our own message is over the daemon's size limit
    UNREACHABLE = "unreachable"  # no connection to the peer, or the peer no longer serves the protocol
    TIMEOUT = "timeout"
    OTHER = "other"


_OWN_LIMIT_TEXTS = ("message size exceeds", "exceeds message size limit")
_UNREACHABLE_TEXTS = (
    "failed to dial",
    "dial backoff",
    "all dials failed",
    "no addresses",
    "no good addresses",
    "failed to find any peer",
    "routing: not found",
    "connection refused",
    "connection reset",
    "stream reset",  # the peer died mid-call
    "broken pipe",
    "protocols not supported",  # the peer is alive, its server is gone
    "protocol not supported",
    "peer id mismatch",
    "resource limit exceeded",
)
_TIMEOUT_TEXTS = ("deadline exceeded", "timed out", "timeout", "i/o timeout")
_EMPTY_STREAM_TEXT = "got an empty iterable"


def daemon_failure(error: P2PDaemonError) -> DaemonFailure:
    text = str(error).lower()
    if any(hint in text for hint in _OWN_LIMIT_TEXTS):
        return DaemonFailure.OWN_LIMIT
    if any(hint in text for hint in _UNREACHABLE_TEXTS):
        return DaemonFailure.UNREACHABLE
    if says_timeout(text):
        return DaemonFailure.TIMEOUT
    return DaemonFailure.OTHER


def says_timeout(text: str) -> bool:
    """Whether an error's (lower-case) text reports a timeout, go-libp2p's or Python's."""
    return any(hint in text for hint in _TIMEOUT_TEXTS)


def stream_ended_empty(error: BaseException) -> bool:
    """Whether ``error`` is asingle's on a reply stream that ended without an item (the peer died mid-reply)."""
    return isinstance(error, ValueError) and _EMPTY_STREAM_TEXT in str(error)
