"""A static HTTP file server for snapshot stores, on the guarded HTTP front (``agora_client.http_service``).

It answers GET and HEAD with one byte range when asked for (206 / Content-Range / 416), an ETag (honoured by
If-None-Match and If-Range) and Last-Modified, so that a client can resume an interrupted snapshot download.
Query strings are ignored, like an object store ignores a presigned URL's signature for the path; directories
are not listed. Each request is a ``RangeRequestHandler`` run in a handler thread. ``GET /metrics`` answers the
server's own series for operators (bytes sent, open connections), not a file of that name.
"""

from __future__ import annotations

import logging
import mimetypes
import os
import posixpath
import re
import stat
import threading
from email.utils import formatdate
from functools import partial
from http import HTTPStatus
from pathlib import Path
from typing import IO, BinaryIO
from urllib.parse import unquote

from agora_client.http_service import Exposure, HttpService, Reply, Request, ServiceLimits
from agora_client.operator_metrics import (
    METRICS_PATH,
    Series,
    SeriesCollector,
    http_front_collector,
    metrics_reply,
    new_registry,
)

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_COPY_BLOCK = 256 * 1024
# Requests carry no body; a transfer holds a handler thread for its whole length.
SNAPSHOT_LIMITS = ServiceLimits(max_body_bytes=0, handler_threads=32, max_pending_requests=128)
BYTES_SENT = Series("agora_snapshot_bytes_sent", "counter", "snapshot bytes sent to joiners (bodies, ranges included)")


class RangeRequestHandler:
    """One request for a file under the server's root. ``send_head`` (choose the answer, open the file) and
    ``send_body`` (write one block of the body) are the seams a subclass overrides to pace or cut a transfer."""

    def __init__(self, request: Request, server: "SnapshotServer"):
        self.command, self.path, self.headers = request.method, request.target, request.headers
        self.server, self.directory = server, str(server.root)
        self.close_connection = False
        self._range: tuple[int, int] | None = None
        self._status: int = HTTPStatus.OK
        self._headers: dict[str, str] = {}
        self._error = b""

    def answer(self) -> Reply:
        source = self.send_head()
        if source is None:
            return Reply(self._status, self._error, self._headers)
        if self.command == "HEAD":
            source.close()
            return Reply(self._status, headers=self._headers)
        return Reply(self._status, headers=self._headers, stream=partial(self._copy_and_close, source))

    def send_head(self) -> IO[bytes] | None:
        """Set the status and headers; return the file positioned at the first byte to send, or None (no body)."""
        self._range = None
        path = self.translate_path(self.path)
        try:
            handle = open(path, "rb")
        except OSError:  # missing, unreadable, or a directory
            return self._fail(HTTPStatus.NOT_FOUND, "File not found")
        facts = os.fstat(handle.fileno())
        if not stat.S_ISREG(facts.st_mode):
            handle.close()
            return self._fail(HTTPStatus.NOT_FOUND, "File not found")
        etag, size = f'"{facts.st_mtime_ns:x}-{facts.st_size:x}"', facts.st_size
        modified = formatdate(facts.st_mtime, usegmt=True)
        self._headers = {
            "Content-Type": _content_type(path),
            "Accept-Ranges": "bytes",
            "ETag": etag,
            "Last-Modified": modified,
        }
        if etag in _entity_tags(self.headers.get("If-None-Match", "")) or self.headers.get("If-None-Match") == "*":
            handle.close()
            self._status = HTTPStatus.NOT_MODIFIED
            return None
        wanted = self._wanted_range(size, etag, modified)
        if wanted == "unsatisfiable":
            handle.close()
            self._status = HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE
            self._headers.update({"Content-Range": f"bytes */{size}", "Content-Length": "0"})
            return None
        if wanted is None:
            self._status = HTTPStatus.OK
            self._headers["Content-Length"] = str(size)
            return handle
        start, end = wanted
        handle.seek(start)
        self._range, self._status = (start, end), HTTPStatus.PARTIAL_CONTENT
        self._headers.update({"Content-Range": f"bytes {start}-{end}/{size}", "Content-Length": str(end - start + 1)})
        return handle

    def copyfile(self, source: IO[bytes], outputfile: BinaryIO) -> None:
        remaining = None if self._range is None else self._range[1] - self._range[0] + 1
        while remaining is None or remaining > 0:
            block = source.read(_COPY_BLOCK if remaining is None else min(_COPY_BLOCK, remaining))
            if not block:
                break
            self.send_body(block, outputfile)
            if remaining is not None:
                remaining -= len(block)

    def send_body(self, block: bytes, outputfile: BinaryIO) -> None:
        """Write one block of a response body; raising cuts the connection."""
        outputfile.write(block)
        self.server.count_sent(len(block))

    def translate_path(self, path: str) -> str:
        """The file under the root that ``path`` names: query and fragment dropped, ``.`` and ``..`` ignored."""
        path = unquote(path.split("?", 1)[0].split("#", 1)[0], errors="surrogatepass")
        parts = [part for part in posixpath.normpath(path).split("/") if part not in ("", os.curdir, os.pardir)]
        return os.path.join(self.directory, *parts)

    def _wanted_range(self, size: int, etag: str, modified: str) -> tuple[int, int] | str | None:
        if "Range" not in self.headers:
            return None
        validator = self.headers.get("If-Range")
        if validator is not None and validator not in (etag, modified):  # the file changed: send it whole
            return None
        return _parse_range(self.headers["Range"], size)

    def _fail(self, status: HTTPStatus, message: str) -> None:
        self._status, self._error = status, f"{message}\n".encode()
        self._headers = {"Content-Type": "text/plain; charset=utf-8"}
        return None

    def _copy_and_close(self, source: IO[bytes], outputfile: BinaryIO) -> None:
        with source:
            self.copyfile(source, outputfile)


class SnapshotServer:
    """``serve_directory``'s result: ``url`` (no trailing slash), ``bytes_sent`` so far, ``close()``."""

    def __init__(
        self,
        root: Path,
        host: str,
        port: int,
        handler: type[RangeRequestHandler],
        limits: ServiceLimits = SNAPSHOT_LIMITS,
        exposure: Exposure = Exposure(),
    ):
        self.root = Path(root)
        self._handler = handler
        self._bytes_sent = 0
        self._count_lock = threading.Lock()
        self._http = HttpService(self._answer, host, port, name="snapshot-http", limits=limits, exposure=exposure)
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

    def count_sent(self, count: int) -> None:
        with self._count_lock:
            self._bytes_sent += count

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SnapshotServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _answer(self, request: Request) -> Reply:
        if request.method not in ("GET", "HEAD"):
            return Reply(
                HTTPStatus.METHOD_NOT_ALLOWED,
                b"a snapshot store answers GET and HEAD only\n",
                {"Allow": "GET, HEAD", "Content-Type": "text/plain; charset=utf-8"},
            )
        if request.method == "GET" and request.path == METRICS_PATH:
            return metrics_reply(self._metrics)
        return self._handler(request, self).answer()


def serve_directory(
    root: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    handler: type[RangeRequestHandler] = RangeRequestHandler,
    exposure: Exposure = Exposure(),
) -> SnapshotServer:
    """Serve ``root`` over HTTP (HTTPS with ``exposure.tls``) in a background thread; the server is up when this returns."""
    if not Path(root).is_dir():
        raise NotADirectoryError(f"cannot serve {root}: it is not a directory")
    return SnapshotServer(root, host, port, handler, exposure=exposure)


def _content_type(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def _entity_tags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(first, last) byte of a single range, "unsatisfiable", or None when the header is not one we honour."""
    match = _RANGE.match(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.groups()
    if first == "":  # suffix range: the last N bytes
        length = int(last)
        if length == 0:
            return "unsatisfiable"
        return (max(0, size - length), size - 1) if size else "unsatisfiable"
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if start >= size or (last != "" and int(last) < start):
        return "unsatisfiable" if start >= size else None
    return start, end
