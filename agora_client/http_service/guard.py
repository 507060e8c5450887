"""Per-connection guards in front of aiohttp, which has neither a request-head timeout nor a connection cap.

``ConnectionGuard`` is the asyncio protocol of each accepted connection and hands everything on to aiohttp's
own protocol. It closes a connection over the caps before aiohttp sees it (so it holds its file descriptor for
no time), and cuts a connection whose request head is not complete within the header timeout. The head counts
from the connection's start, or from the first byte after the previous answer; the service tells the guard
when aiohttp handed it the parsed head (``head_received``) and when the answer is done (``request_done``).

With TLS the guard admits the bare TCP connection and then runs the handshake on it (``loop.start_tls``), so the
caps hold for connections still in their handshake too, and a handshake counts against the header timeout.
A trusted reverse proxy carries many clients' requests: its connections count against the overall cap only.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from .forwarded import NO_TRUSTED_PROXIES, TrustedProxies
from .limits import client_key

log = logging.getLogger(__name__)


class ConnectionTable:
    """Open connections, overall and per client key (``client_key``); used from the event loop only.

    Connections from ``uncapped`` addresses (trusted proxies) count against the overall cap alone.
    """

    def __init__(self, max_total: int, max_per_key: int, uncapped: TrustedProxies = NO_TRUSTED_PROXIES):
        self.max_total, self.max_per_key, self.uncapped = max_total, max_per_key, uncapped
        self.total = 0
        self._per_key: dict[str, int] = {}

    def admit(self, address: str) -> str | None:
        """The key the connection from ``address`` is counted under, or None if the caps leave no room for it."""
        key = client_key(address)
        held = self._per_key.get(key, 0)
        if self.total >= self.max_total or (held >= self.max_per_key and address not in self.uncapped):
            return None
        self.total += 1
        self._per_key[key] = held + 1
        return key

    def release(self, key: str) -> None:
        self.total -= 1
        held = self._per_key.pop(key) - 1
        if held:
            self._per_key[key] = held


class ConnectionGuard(asyncio.Protocol):
    def __init__(
        self,
        inner_factory: Callable[[], asyncio.Protocol],
        table: ConnectionTable,
        header_timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ):
        self._inner_factory, self._table, self._header_timeout_s, self._tls = (
            inner_factory,
            table,
            header_timeout_s,
            tls,
        )
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._key: str | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._handshake: asyncio.Task | None = None
        self._early: list[bytes] = []  # decrypted before aiohttp's protocol is handed the connection
        self._between_requests = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        key = self._table.admit(peer[0] if peer else "unknown")
        if key is None:
            log.debug("closed a connection from %s over the connection caps", peer)
            transport.abort()
            return
        self._key, self._transport = key, transport  # type: ignore[assignment]
        self._arm_head_timer()
        if self._tls is None:
            self._hand_on(transport)
        else:  # the client's first bytes wait in the socket for the TLS layer, which resumes reading
            transport.pause_reading()  # type: ignore[attr-defined]
            self._handshake = asyncio.get_running_loop().create_task(self._secure(transport))

    async def _secure(self, transport: asyncio.BaseTransport) -> None:
        """The TLS handshake; then aiohttp gets the decrypted stream, this guard staying the protocol above it."""
        secured = None
        try:
            if not transport.is_closing():  # a client gone before the handshake began would leave it waiting forever
                handshake = asyncio.get_running_loop().start_tls(
                    transport,
                    self,
                    self._tls,
                    server_side=True,
                    ssl_handshake_timeout=self._header_timeout_s,
                )
                secured = await asyncio.wait_for(handshake, self._header_timeout_s + 1)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as error:
            log.debug("TLS handshake with %s failed: %s", transport.get_extra_info("peername"), error)
        if secured is None or self._key is None:  # failed, or the client left during (or just after) the handshake
            transport.abort()
            self._release()
            return
        self._hand_on(secured)

    def _hand_on(self, transport: asyncio.BaseTransport) -> None:
        self._inner = self._inner_factory()
        self._inner.connection_made(transport)
        early, self._early = self._early, []
        for data in early:
            self._inner.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            # The TLS layer hands on what came with the handshake's end before start_tls returns to ``_secure``.
            if self._key is not None:
                self._early.append(data)
            return
        if self._between_requests:  # the first byte of the next request head
            self._between_requests = False
            self._arm_head_timer()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def _release(self) -> None:
        """Give the connection's place back, once (a failed handshake may end here twice)."""
        self._cancel_head_timer()
        if self._key is not None:
            self._table.release(self._key)
            self._key = None

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
