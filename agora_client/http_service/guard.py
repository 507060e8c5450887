"""Per-connection guards in front of aiohttp, which has neither a request-head timeout nor a connection cap.

``ConnectionGuard`` is the asyncio protocol of each accepted connection and hands everything on to aiohttp's
own protocol. It closes a connection over the caps before aiohttp sees it (so it holds its file descriptor for
no time), and cuts a connection whose request head is not complete within the header timeout. The head counts
from the connection's start, or from the first byte after the previous answer; the service tells the guard
when aiohttp handed it the parsed head (``head_received``) and when the answer is done (``request_done``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .limits import client_key

log = logging.getLogger(__name__)


class ConnectionTable:
    """Open connections, overall and per client key; used from the event loop only."""

    def __init__(self, max_total: int, max_per_key: int):
        self.max_total, self.max_per_key = max_total, max_per_key
        self.total = 0
        self._per_key: dict[str, int] = {}

    def admit(self, key: str) -> bool:
        held = self._per_key.get(key, 0)
        if self.total >= self.max_total or held >= self.max_per_key:
            return False
        self.total += 1
        self._per_key[key] = held + 1
        return True

    def release(self, key: str) -> None:
        self.total -= 1
        held = self._per_key.pop(key) - 1
        if held:
            self._per_key[key] = held


class ConnectionGuard(asyncio.Protocol):
    def __init__(self, inner_factory: Callable[[], asyncio.Protocol], table: ConnectionTable, header_timeout_s: float):
        self._inner_factory, self._table, self._header_timeout_s = inner_factory, table, header_timeout_s
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._key: str | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._between_requests = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        key = client_key(peer[0]) if peer else "unknown"
        if not self._table.admit(key):
            log.debug("closed a connection from %s over the connection caps", key)
            transport.abort()
            return
        self._key, self._transport = key, transport  # type: ignore[assignment]
        self._inner = self._inner_factory()
        self._inner.connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if self._between_requests:  # the first byte of the next request head
            self._between_requests = False
            self._arm_head_timer()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._key is not None:
            self._table.release(self._key)
            self._key = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def head_received(self) -> None:
        self._cancel_head_timer()
        self._between_requests = False

    def request_done(self) -> None:
        self._between_requests = True

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._header_timeout_s, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        log.debug("cut a connection from %s: no complete request head in %.0f s", self._key, self._header_timeout_s)
        if self._transport is not None:
            self._transport.abort()
