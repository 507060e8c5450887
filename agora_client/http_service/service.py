"""``HttpService``: a synchronous handler served by aiohttp from an event loop in a background thread.

The handler runs in a bounded thread pool (the auth service's handlers block: a dial-back waits seconds, an
identity lookup makes an HTTP call), so the event loop only moves bytes and keeps answering. Per request the
loop applies the rate limit of its route, the body size limit and the body read timeout before the handler
sees anything; per connection the guards of ``guard.py`` apply. ``exposure`` adds TLS (the guard runs the
handshake) and the trusted proxies through which a request's source address is resolved (``forwarded.py``):
rate limits, the handler's ``Request.source`` and the log all see the client, not its proxy.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from aiohttp import web

from .exposure import PLAIN_HTTP, Exposure
from .guard import ConnectionGuard, ConnectionTable
from .limits import (
    DEFAULT_LIMITS,
    RateLimit,
    RateLimiter,
    ServiceLimits,
    connection_cap,
    raise_open_file_limit,
    retry_after_header,
)
from .messages import Reply, Request, json_reply
from .upload_probe import measure_upload, probe_response

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024
SERVER_HEADER = {"Server": "agora"}  # not aiohttp's default, which names library and Python versions
SHUTDOWN_GRACE_S = 0.5
QUICK_THREADS = 4


class _BodyTooLarge(Exception):
    pass


class HttpService:
    """Serves ``handler`` on ``host``:``port`` (0: any free port); bound on construction, serving after ``start()``.

    ``rate_limits`` maps (method, path) to the ``RateLimit`` each client address gets on that route.
    ``quick_routes`` (method, path) never block: they get handler threads of their own, so that handlers blocked
    elsewhere (a dial-back, a write to disk) never hold them up. ``upload_probes`` (method, path) are answered by
    the front itself: the body is timed as it arrives and dropped (``upload_probe.py``), never given to the handler.
    ``direct`` answers requests without a body on the event loop itself, so it must not block (the snapshot server
    sends files with it); its None hands the request on to ``handler``. ``exposure``: TLS and trusted reverse proxies.
    """

    def __init__(
        self,
        handler: Callable[[Request], Reply],
        host: str,
        port: int,
        *,
        name: str,
        limits: ServiceLimits = DEFAULT_LIMITS,
        rate_limits: Mapping[tuple[str, str], RateLimit] | None = None,
        quick_routes: Collection[tuple[str, str]] = (),
        upload_probes: Collection[tuple[str, str]] = (),
        direct: Callable[[web.BaseRequest], Awaitable[web.StreamResponse | None]] | None = None,
        exposure: Exposure = PLAIN_HTTP,
    ):
        self.handler, self.name, self.limits, self.exposure = handler, name, limits, exposure
        self._direct = direct
        self._table = ConnectionTable(
            connection_cap(limits, raise_open_file_limit()),
            limits.max_connections_per_address,
            exposure.trusted_proxies,
        )
        self._limiters = {route: RateLimiter(limit) for route, limit in (rate_limits or {}).items()}
        self._socket = _listening_socket(host, port)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self._quick_routes, self._upload_probes = frozenset(quick_routes), frozenset(upload_probes)
        self._pools = {
            quick: _HandlerPool(threads, limits.max_pending_requests, f"{name}-{'quick' if quick else 'handler'}")
            for quick, threads in ((False, limits.handler_threads), (True, QUICK_THREADS))
        }
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"{self.exposure.scheme}://[{host}]:{port}" if ":" in host else f"{self.exposure.scheme}://{host}:{port}"

    @property
    def open_connections(self) -> int:
        return self._table.total

    def start(self) -> "HttpService":
        self._thread.start()
        if not self._serving.wait(timeout=10):
            raise RuntimeError(f"the {self.name} HTTP service did not start within 10 s")
        return self

    def close(self) -> None:
        """Stop serving and close every connection; handlers still running in threads are left to finish."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=5)
        for pool in self._pools.values():
            pool.executor.shutdown(wait=False, cancel_futures=True)
        self._socket.close()

    def _run_loop(self) -> None:
        # asyncio's own loop, whatever the process's policy: hivemind installs uvloop process-wide, whose start_tls
        # does not take over a paused transport as ConnectionGuard's TLS handshake needs (clients then hang or fail).
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        protocol = web.Server(
            self._handle,
            access_log=None,
            keepalive_timeout=self.limits.keepalive_timeout_s,
            lingering_time=self.limits.body_timeout_s,
        )
        server = await self._loop.create_server(
            lambda: ConnectionGuard(protocol, self._table, self.limits.header_timeout_s, self.exposure.tls),
            sock=self._socket,
            backlog=LISTEN_BACKLOG,
        )
        self._serving.set()
        await self._stop.wait()
        server.close()
        protocol.pre_shutdown()
        await protocol.shutdown(SHUTDOWN_GRACE_S)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        guard = request.transport.get_protocol() if request.transport is not None else None
        if isinstance(guard, ConnectionGuard):
            guard.head_received()
        source = self.exposure.trusted_proxies.client_address(
            request.remote or "unknown",
            request.headers.getall("X-Forwarded-For", ()),
        )
        try:
            response = await self._answer(request, source)
        finally:
            if isinstance(guard, ConnectionGuard):
                guard.request_done()
        # Method, path and status only: bodies (where tokens travel) and query strings (signatures) are never logged.
        log.debug("%s: %s %s %s -> %d", self.name, source, request.method, request.path, response.status)
        return response

    async def _answer(self, request: web.BaseRequest, source: str) -> web.StreamResponse:
        """The handler's answer, or the front's refusal.

        ``source`` is the client's address (through trusted proxies)."""
        limiter = self._limiters.get((request.method, request.path))
        wait_s = limiter.wait_s(source) if limiter is not None else 0.0
        if wait_s > 0:
            return _refusal(
                HTTPStatus.TOO_MANY_REQUESTS,
                "too many requests from your address on this endpoint; "
                f"wait {retry_after_header(wait_s)} s (Retry-After) and try again",
                retry_after_s=wait_s,
            )
        if self._direct is not None and not request.body_exists:
            response = await self._direct(request)
            if response is not None:
                response.headers.update(SERVER_HEADER)
                return response
        if (request.method, request.path) in self._upload_probes:
            status, payload = await measure_upload(request, self.limits.body_timeout_s)
            return probe_response(status, payload, {**SERVER_HEADER, "Cache-Control": "no-store"})
        pool = self._pools[(request.method, request.path) in self._quick_routes]
        if pool.pending >= pool.max_pending:
            return _refusal(
                HTTPStatus.SERVICE_UNAVAILABLE, "the service is busy; try again in a moment", retry_after_s=1
            )
        try:
            body = await asyncio.wait_for(_read_body(request, self.limits.max_body_bytes), self.limits.body_timeout_s)
        except _BodyTooLarge:
            return _refusal(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body over {self.limits.max_body_bytes} bytes", close=True
            )
        except asyncio.TimeoutError:
            return _refusal(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                close=True,
            )
        message = Request(request.method, request.path, request.raw_path, request.headers, body, source)
        pool.pending += 1
        try:
            reply = await self._run(pool, message)
        finally:
            pool.pending -= 1
        return web.Response(status=reply.status, body=reply.body, headers={**SERVER_HEADER, **reply.headers})

    async def _run(self, pool: "_HandlerPool", message: Request) -> Reply:
        try:
            return await asyncio.get_running_loop().run_in_executor(pool.executor, self.handler, message)
        except Exception:  # the service keeps running; the client gets one line, the log the traceback
            log.exception("internal error in %s answering %s %s", self.name, message.method, message.path)
            return json_reply(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"status": "error", "error": "internal error; try again later"}
            )


class _HandlerPool:
    """Handler threads and the requests waiting for or running in them (counted from the event loop only)."""

    def __init__(self, threads: int, max_pending: int, name: str):
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.max_pending, self.pending = max_pending, 0


async def _read_body(request: web.BaseRequest, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise _BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:  # a chunked body announces no length
            raise _BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def _refusal(
    status: HTTPStatus, message: str, *, retry_after_s: float | None = None, close: bool = False
) -> web.Response:
    """An answer the service gives without the handler.

    JSON with ``error`` (what Agora's clients read) and ``message``."""
    headers = {**SERVER_HEADER, "Cache-Control": "no-store"}
    if retry_after_s is not None:
        headers["Retry-After"] = retry_after_header(retry_after_s)
    reply = json_reply(status, {"status": "error", "error": message, "message": message}, headers)
    response = web.Response(status=reply.status, body=reply.body, headers=reply.headers)
    if close:  # an unread or half-read body must not be taken for the next request
        response.force_close()
    return response


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener
