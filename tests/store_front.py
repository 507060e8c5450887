"""A test's own HTTP front to a real snapshot server: it forwards every request and lets the test watch, hold,
pace, alter or cut what passes.

The snapshot server sends files with sendfile(2), so nothing can reach into a transfer inside it; a test that needs
a slow, broken or lying store puts this front between the server and the downloader instead. Subclasses override
``on_request`` and ``relay_body``; both run on the front's event loop, so they wait with ``await``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import aiohttp
from aiohttp import web

BLOCK = 64 * 1024
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "date", "server"}


class StoreFront:
    """Forwards to ``upstream``, a snapshot server; ``url`` is its own, ``bytes_sent`` the body bytes passed on."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.url = ""
        self.bytes_sent = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), name="store-front", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the store front did not start within 30 s")

    async def on_request(self, target: str, headers: Mapping[str, str]) -> None:
        """Called with each request's path and query before it is forwarded."""

    async def relay_body(
        self, target: str, blocks: AsyncIterator[bytes], send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """Passes a response body on; raising drops the client's connection after what was sent."""
        async for block in blocks:
            await send(block)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self) -> "StoreFront":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        async with aiohttp.ClientSession(auto_decompress=False, timeout=timeout) as session:
            self._session = session
            runner = web.ServerRunner(web.Server(self._forward))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        await self.on_request(request.path_qs, request.headers)
        headers = {name: value for name, value in request.headers.items() if name.lower() not in HOP_BY_HOP}
        async with self._session.request(
            request.method, self.upstream + request.raw_path, headers=headers, allow_redirects=False
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={name: value for name, value in upstream.headers.items() if name.lower() not in HOP_BY_HOP},
            )
            if upstream.content_length is not None and upstream.status != 304:
                response.content_length = upstream.content_length
            await response.prepare(request)

            async def send(block: bytes) -> None:
                await response.write(block)
                self.bytes_sent += len(block)

            try:
                await self.relay_body(request.path_qs, upstream.content.iter_chunked(BLOCK), send)
            except Exception:  # the subclass cut the transfer: the client sees a short body
                if request.transport is not None:
                    request.transport.abort()
                return response
            await response.write_eof()
            return response
