"""A static HTTP file server for snapshot stores, on the guarded HTTP front (``agora_client.http_service``).

Files go out through aiohttp's FileResponse on the front's event loop (sendfile(2) on plain HTTP; with TLS the
loop reads and encrypts), so a wave of joiners holds connections, not threads. GET and HEAD, one byte range
(206 / Content-Range; a range that cannot be served 416), an ETag (``"<mtime_ns hex>-<size hex>"``, honoured by
If-None-Match and If-Range) and Last-Modified, so that a client resumes an interrupted download and never
resumes a file that changed. Query strings are ignored, like an object store ignores a presigned URL's
signature for the path; directories are not listed, and no request reaches a file outside the root (``..``,
symlinks out). ``GET /metrics`` answers the server's own series for operators (bytes sent, open connections),
not a file of that name.
"""

from __future__ import annotations

import asyncio
import math
import os
import stat
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import parse_http_date

from agora_client.http_service import PLAIN_HTTP, Exposure, HttpService, Reply, Request, ServiceLimits
from agora_client.operator_metrics import (
    METRICS_PATH,
    Series,
    SeriesCollector,
    http_front_collector,
    metrics_reply,
    new_registry,
)

SNAPSHOT_LIMITS = ServiceLimits(max_body_bytes=0)  # requests carry no body
BYTES_SENT = Series("agora_snapshot_bytes_sent", "counter", "snapshot bytes sent to joiners (bodies, ranges included)")
NOT_FOUND = "File not found\n"


class SnapshotServer:
    """``serve_directory``'s result: ``url`` (no trailing slash), ``bytes_sent`` so far, ``close()``."""

    def __init__(self, root: Path, host: str, port: int, exposure: Exposure = PLAIN_HTTP):
        self.root = Path(root).resolve()
        self._bytes_sent = 0
        self._http = HttpService(
            self._answer,
            host,
            port,
            name="snapshot-http",
            limits=SNAPSHOT_LIMITS,
            direct=self._serve_file,
            exposure=exposure,
        )
        self._metrics = new_registry(
            SeriesCollector([BYTES_SENT], lambda: {BYTES_SENT.name: self._bytes_sent}), http_front_collector(self._http)
        )
        self._http.start()

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SnapshotServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _serve_file(self, request: web.BaseRequest) -> web.StreamResponse | None:
        """A file's answer, on the event loop; None hands the request to ``_answer`` (metrics, other methods)."""
        if request.method not in ("GET", "HEAD") or (request.method == "GET" and request.path == METRICS_PATH):
            return None
        path = await asyncio.to_thread(file_under, self.root, request.path)
        if path is None:
            return web.Response(status=HTTPStatus.NOT_FOUND, text=NOT_FOUND)
        return SnapshotFileResponse(path, self._count_sent)

    def _count_sent(self, count: int) -> None:
        self._bytes_sent += count  # on the event loop only

    def _answer(self, request: Request) -> Reply:
        if request.method == "GET" and request.path == METRICS_PATH:
            return metrics_reply(self._metrics)
        return Reply(
            HTTPStatus.METHOD_NOT_ALLOWED,
            b"a snapshot store answers GET and HEAD only\n",
            {"Allow": "GET, HEAD", "Content-Type": "text/plain; charset=utf-8"},
        )


class SnapshotFileResponse(web.FileResponse):
    """FileResponse with If-Range decided on the file it opened, and the body bytes it sent counted.

    aiohttp reads If-Range as a date only and serves the range whenever that parse fails, so an ETag in it would
    resume a changed file. Here If-Range is compared with the opened file's own ETag (strong) and Last-Modified:
    a match serves the range, anything else the whole file with 200. These override private methods of aiohttp
    3.14.5 (requirements.txt pins it); tests/test_snapshot_server.py fails if they stop being called.
    """

    def __init__(self, path: Path, count_sent: Callable[[int], None]):
        super().__init__(path)
        self._count_sent = count_sent

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        # Without Accept-Encoding aiohttp never answers with a ``.gz`` or ``.br`` file next to the one asked for.
        return await super().prepare(_without(request, hdrs.ACCEPT_ENCODING))

    async def _prepare_open_file(self, request, fobj, st, file_encoding):  # type: ignore[no-untyped-def]
        validator = request.headers.get(hdrs.IF_RANGE)
        if validator is not None:
            current = _if_range_holds(validator.strip(), st)
            request = _without(request, hdrs.IF_RANGE) if current else _without(request, hdrs.IF_RANGE, hdrs.RANGE)
        return await super()._prepare_open_file(request, fobj, st, file_encoding)

    async def _sendfile(self, request, fobj, offset, count):  # type: ignore[no-untyped-def]
        try:
            return await super()._sendfile(request, fobj, offset, count)
        finally:  # sendfile leaves the file's position after the last byte it sent, also when the client left early
            self._count_sent(max(0, fobj.tell() - offset))


def file_under(root: Path, url_path: str) -> Path | None:
    """The regular file under ``root`` that ``url_path`` (already percent-decoded) names, or None.

    ``..`` and a resolved path outside ``root`` (a symlink out, an absolute path) name nothing.
    """
    parts = [part for part in url_path.split("/") if part not in ("", ".")]
    if not parts or ".." in parts or "\0" in url_path:
        return None
    try:
        path = root.joinpath(*parts).resolve(strict=True)
        facts = path.stat()
    except (OSError, RuntimeError):  # missing, unreadable, or a symlink loop
        return None
    if not path.is_relative_to(root) or not stat.S_ISREG(facts.st_mode):
        return None
    return path


def serve_directory(
    root: Path, host: str = "127.0.0.1", port: int = 0, *, exposure: Exposure = PLAIN_HTTP
) -> SnapshotServer:
    """Serve ``root`` over HTTP (HTTPS with ``exposure.tls``) from a background thread; up when this returns."""
    if not Path(root).is_dir():
        raise NotADirectoryError(f"cannot serve {root}: it is not a directory")
    return SnapshotServer(root, host, port, exposure)


def _if_range_holds(validator: str, st: os.stat_result) -> bool:
    """Whether If-Range names this very file: its strong ETag, or exactly its Last-Modified date."""
    if validator.startswith('"'):
        return validator == f'"{st.st_mtime_ns:x}-{st.st_size:x}"'  # FileResponse's ETag
    date = parse_http_date(validator)
    return date is not None and date.timestamp() == math.ceil(st.st_mtime)  # FileResponse's Last-Modified


def _without(request: web.BaseRequest, *names: str) -> web.BaseRequest:
    if not any(name in request.headers for name in names):
        return request
    headers = request.headers.copy()
    for name in names:
        headers.popall(name, None)
    return request.clone(headers=headers)
