"""What the HTTP front allows: timeouts, caps, per-address rate limits, and the process's open-file limit."""

from __future__ import annotations

import ipaddress
import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# File descriptors kept for everything but client connections (logs, state files, DHT sockets, dial-backs).
RESERVED_DESCRIPTORS = 256


@dataclass(frozen=True)
class ServiceLimits:
    header_timeout_s: float = 10.0
    """Longest a client may take to send a whole request head (the time from its first byte, not per line)."""
    body_timeout_s: float = 10.0
    """Longest a client may take to send a whole request body."""
    keepalive_timeout_s: float = 15.0
    """How long an idle keep-alive connection stays open."""
    max_connections: int = 4096
    """Open client connections overall (lowered to fit the open-file limit); more are closed at once."""
    max_connections_per_address: int = 64
    """Open connections from one client address (one IPv6 /64); more are closed at once."""
    max_body_bytes: int = 64 * 1024
    handler_threads: int = 16
    """Threads that run the synchronous handler (a service's quick routes have 4 more); never the event loop."""
    max_pending_requests: int = 256
    """Requests waiting for or running in a handler thread; more are answered 503 at once."""

    def __post_init__(self) -> None:
        if min(self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s) <= 0:
            raise ValueError("HTTP timeouts must be positive")
        if (
            min(self.max_connections, self.max_connections_per_address, self.handler_threads, self.max_pending_requests)
            < 1
        ):
            raise ValueError("HTTP connection caps, handler threads and pending requests must be at least 1")
        if self.max_body_bytes < 0:
            raise ValueError("the HTTP body size limit must not be negative")


DEFAULT_LIMITS = ServiceLimits()


@dataclass(frozen=True)
class RateLimit:
    """A token bucket per client address: ``burst`` requests at once, refilled at ``per_minute``."""

    per_minute: float
    burst: int
    exempt_loopback: bool = True
    """Leave this host's own clients alone (a local swarm joins many workers from 127.0.0.1 at once)."""

    def __post_init__(self) -> None:
        if self.per_minute <= 0 or self.burst < 1:
            raise ValueError("a rate limit needs a positive rate and a burst of at least 1")


class RateLimiter:
    """One ``RateLimit`` applied per client address; used from the event loop only, so it needs no lock."""

    MAX_TRACKED = 100_000

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)

    def wait_s(self, source: str) -> float:
        """0 and one request taken if the client at ``source`` may go on now, else the seconds until it may."""
        if self.limit.exempt_loopback and _is_loopback(source):
            return 0.0
        address, now, rate = client_key(source), self._clock(), self.limit.per_minute / 60.0
        tokens, at = self._buckets.get(address, (float(self.limit.burst), now))
        tokens = min(float(self.limit.burst), tokens + (now - at) * rate)
        if tokens < 1.0:
            self._buckets[address] = (tokens, now)
            return (1.0 - tokens) / rate
        if len(self._buckets) >= self.MAX_TRACKED:
            self._forget_full(now, rate)
        self._buckets[address] = (tokens - 1.0, now)
        return 0.0

    def _forget_full(self, now: float, rate: float) -> None:
        # A bucket refilled to its burst says nothing a fresh one would not: memory stays bounded.
        self._buckets = {
            address: (tokens, at)
            for address, (tokens, at) in self._buckets.items()
            if tokens + (now - at) * rate < self.limit.burst
        }


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))


def client_key(address: str) -> str:
    """What caps and rate limits count by: the address, or its /64 for IPv6 (one host holds a whole /64)."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(parsed)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            log.info("raised the open-file limit from %d to %d (its hard limit)", soft, wanted)
            soft = wanted
        except (ValueError, OSError) as error:
            log.warning(
                "could not raise the open-file limit from %d to %d (%s); fewer connections fit", soft, wanted, error
            )
    return soft


def connection_cap(limits: ServiceLimits, open_files: int) -> int:
    """``limits.max_connections``, lowered so that client connections cannot use up the open-file limit."""
    room = max(1, open_files - RESERVED_DESCRIPTORS)
    if limits.max_connections > room:
        log.warning(
            "serving at most %d connections, not %d: the open-file limit is %d (raise it with ulimit -n)",
            room,
            limits.max_connections,
            open_files,
        )
    return min(limits.max_connections, room)
