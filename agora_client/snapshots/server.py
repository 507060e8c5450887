"""A static HTTP file server with single-range support (206 / Content-Range / 416), in a background thread.

The standard library's SimpleHTTPRequestHandler always sends whole files, so a client could not
resume an interrupted snapshot download against it; this handler adds ``Range: bytes=...``.
Query strings are ignored, like an object store ignores a presigned URL's signature for the path.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from functools import partial
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_COPY_BLOCK = 256 * 1024


class RangeRequestHandler(SimpleHTTPRequestHandler):
    """Serves files under ``directory``; one byte range per request when asked for."""

    protocol_version = "HTTP/1.1"
    server_version = "agora-snapshots/1"

    def send_head(self) -> IO[bytes] | None:
        self._range: tuple[int, int] | None = None
        path = self.translate_path(self.path)
        if os.path.isdir(path) or "Range" not in self.headers:
            return super().send_head()
        try:
            handle = open(path, "rb")
        except OSError:
            self.send_error(HTTPStatus.NOT_FOUND, "File not found")
            return None
        size = os.fstat(handle.fileno()).st_size
        wanted = _parse_range(self.headers["Range"], size)
        if wanted is None:  # not a single bytes range: RFC 9110 lets us answer with the whole file
            handle.close()
            return super().send_head()
        if wanted == "unsatisfiable":
            handle.close()
            self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        start, end = wanted
        handle.seek(start)
        self._range = (start, end)
        self.send_response(HTTPStatus.PARTIAL_CONTENT)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return handle

    def end_headers(self) -> None:
        if not getattr(self, "_range", None):
            self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def copyfile(self, source: IO[bytes], outputfile: IO[bytes]) -> None:
        remaining = None if self._range is None else self._range[1] - self._range[0] + 1
        while remaining is None or remaining > 0:
            block = source.read(_COPY_BLOCK if remaining is None else min(_COPY_BLOCK, remaining))
            if not block:
                break
            self.send_body(block, outputfile)
            if remaining is not None:
                remaining -= len(block)

    def send_body(self, block: bytes, outputfile: IO[bytes]) -> None:
        """Write one block of a response body (the seam tests use to cut a transfer)."""
        outputfile.write(block)
        self.server.count_sent(len(block))  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _FileHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bytes_sent = 0
        self._count_lock = threading.Lock()

    def count_sent(self, count: int) -> None:
        with self._count_lock:
            self.bytes_sent += count

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-transfer is routine for a download server, not a crash.
        log.debug("transfer to %s ended early", client_address, exc_info=True)


class SnapshotServer:
    """``serve_directory``'s result: ``url`` (no trailing slash), ``bytes_sent`` so far, ``close()``."""

    def __init__(self, root: Path, host: str, port: int, handler: type[RangeRequestHandler]):
        self.root = Path(root)
        self._httpd = _FileHTTPServer((host, port), partial(handler, directory=str(self.root)))
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="snapshot-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def bytes_sent(self) -> int:
        return self._httpd.bytes_sent

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "SnapshotServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_directory(
    root: Path, host: str = "127.0.0.1", port: int = 0, *, handler: type[RangeRequestHandler] = RangeRequestHandler
) -> SnapshotServer:
    """Serve ``root`` over HTTP in a background thread; the server is up when this returns."""
    if not Path(root).is_dir():
        raise NotADirectoryError(f"cannot serve {root}: it is not a directory")
    return SnapshotServer(root, host, port, handler)


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
