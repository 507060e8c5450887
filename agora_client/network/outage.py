"""Riding out an outage of the swarm's services (auth service, snapshot server) once the runtime has reached them.

A connection that fails (refused, reset, timed out) or an answer of HTTP 502/503/504 is an outage: the operator's
host restarting, a proxy with its backend down. It is said once, as a ``[NETWORK]`` line, and the call is tried
again with a backoff capped at ``max_wait_s``, for at most ``limit_s``; then the caller fails as it would have at
once. A stop (Ctrl-C) ends the wait at once. A first start against a wrong URL does not get here: only a runtime
that already holds the run description passes an Outage to the calls it makes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from agora_client.events import EventWriter

OUTAGE_LIMIT_S = 600.0  # how long a joining runtime waits for the swarm's services to come back
OUTAGE_STATUSES = frozenset({502, 503, 504})  # a proxy or balancer in front of a service that is down


class Outage:
    """The waits of one caller for one service (``what``: "the swarm's auth service at HOST"); not shared by threads.

    ``wait()`` after each failure that is an outage, ``ended()`` after a success."""

    def __init__(
        self,
        what: str,
        events: EventWriter,
        stop: threading.Event,
        *,
        limit_s: float = OUTAGE_LIMIT_S,
        first_wait_s: float = 0.5,
        max_wait_s: float = 5.0,
    ):
        self.what, self.events, self.stop = what, events, stop
        self.limit_s, self.first_wait_s, self.max_wait_s = limit_s, first_wait_s, max_wait_s
        self._since: float | None = None  # time.monotonic() of the first failure of this outage
        self._next_wait_s = first_wait_s
        self._gave_up = False  # said once: later failures of the same caller fail at once

    def wait(self) -> bool:
        """Wait before the next try; True once it is due, False when the outage has lasted ``limit_s`` or the
        runtime is stopping (the caller then fails with its usual error)."""
        now = time.monotonic()
        if self._since is None:
            self._since, self._next_wait_s = now, self.first_wait_s
            self.events.log(
                f"{self.what} is unreachable since {time.strftime('%H:%M:%S')}; retrying every "
                f"{self.max_wait_s:g} s at most, for up to {_duration(self.limit_s)}",
                tag="NETWORK",
                level="warning",
            )
        left_s = self.limit_s - (now - self._since)
        if left_s <= 0:
            if not self._gave_up:
                self._gave_up = True
                self.events.log(
                    f"{self.what} stayed unreachable for {_duration(self.limit_s)}: giving up", tag="NETWORK"
                )
            return False
        pause_s = min(self._next_wait_s, left_s)
        self._next_wait_s = min(self._next_wait_s * 2, self.max_wait_s)
        return not self.stop.wait(pause_s)

    def ended(self) -> None:
        """The service answered: say it is back if it had been down."""
        if self._since is not None:
            down_s = time.monotonic() - self._since
            self._since, self._gave_up = None, False
            self.events.log(f"{self.what} is reachable again after {down_s:.0f} s", tag="NETWORK")

    def send(self, request: Callable[[], httpx.Response]) -> httpx.Response:
        """``request()``'s response, tried again through an outage; past it, the last failure raised or returned."""
        while True:
            try:
                response = request()
            except httpx.TransportError as error:
                if is_outage(error) and self.wait():
                    continue
                raise
            if response.status_code in OUTAGE_STATUSES and self.wait():
                response.close()  # a streamed answer holds its connection until closed
                continue
            self.ended()
            return response


def is_outage(error: httpx.HTTPError) -> bool:
    """A failure to connect or to get an answer; not a malformed URL or a refused protocol (a user's mistake)."""
    return isinstance(error, httpx.TransportError) and not isinstance(
        error, (httpx.UnsupportedProtocol, httpx.ProxyError)
    )


def send(outage: Outage | None, request: Callable[[], httpx.Response]) -> httpx.Response:
    """``request()`` through ``outage`` when there is one; at once otherwise (a first start fails fast)."""
    return outage.send(request) if outage is not None else request()


def _duration(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"
