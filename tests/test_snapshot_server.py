"""The snapshot server (aiohttp, FileResponse with sendfile) on 127.0.0.1: ranges, conditional requests, HEAD,
paths that leave the store, TLS, and transfers held by clients that stopped reading."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx
import pytest

from agora_client.http_service import Exposure, server_tls_context
from agora_client.snapshots import SnapshotServer, serve_directory
from tests.tls_helpers import make_tls_files

PAYLOAD = bytes(range(256)) * 40  # 10,240 bytes
WAIT_S = 30.0


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    (root / "body1").mkdir(parents=True)
    (root / "body1" / "blob.bin").write_bytes(PAYLOAD)
    return root


def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """GET ``target`` exactly as written (httpx would normalise ``..`` away)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT_S)
    try:
        connection.request("GET", target)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def wait_for_count(server: SnapshotServer, reached: Callable[[int], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not reached(server.bytes_sent):
        assert time.monotonic() < deadline, f"the server counted {server.bytes_sent} bytes sent"
        time.sleep(0.05)


def test_ranges_are_served_and_bad_or_unsatisfiable_ones_get_416(store: Path):
    size = len(PAYLOAD)
    with serve_directory(store) as server, httpx.Client(base_url=server.url) as client:
        whole = client.get("/body1/blob.bin")
        assert whole.status_code == 200 and whole.content == PAYLOAD
        assert whole.headers["Accept-Ranges"] == "bytes" and whole.headers["Content-Length"] == str(size)
        assert whole.headers["Server"] == "agora"  # not aiohttp's, which names its and Python's versions
        for header, first, last in (
            ("bytes=100-199", 100, 199),
            ("bytes=10000-", 10000, size - 1),
            ("bytes=-5", size - 5, size - 1),
            ("bytes=10000-99999", 10000, size - 1),  # a last byte past the end is the end
            ("bytes=0-0", 0, 0),
        ):
            part = client.get("/body1/blob.bin", headers={"Range": header})
            assert part.status_code == 206, header
            assert part.content == PAYLOAD[first : last + 1], header
            assert part.headers["Content-Range"] == f"bytes {first}-{last}/{size}", header
        for header in (f"bytes={size}-", "bytes=99999-", "bytes=200-100", "bytes=0-1,5-6", "pages=1-2", "bytes=x-"):
            refused = client.get("/body1/blob.bin", headers={"Range": header})
            assert refused.status_code == 416 and refused.content == b"", header
            assert refused.headers["Content-Range"] == f"bytes */{size}", header


def test_if_range_with_the_current_etag_resumes_and_a_changed_file_is_sent_whole(store: Path):
    path = store / "body1" / "blob.bin"
    with serve_directory(store) as server, httpx.Client(base_url=server.url) as client:
        etag = client.head("/body1/blob.bin").headers["ETag"]
        stat = path.stat()
        assert etag == f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"'  # the scheme clients keep between runs
        resumed = client.get("/body1/blob.bin", headers={"Range": "bytes=4000-", "If-Range": etag})
        assert resumed.status_code == 206 and resumed.content == PAYLOAD[4000:]

        changed = PAYLOAD[::-1]
        path.write_bytes(changed)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a coarse clock would hide it
        stale = client.get("/body1/blob.bin", headers={"Range": "bytes=4000-", "If-Range": etag})
        assert stale.status_code == 200 and stale.content == changed
        assert "Content-Range" not in stale.headers and stale.headers["ETag"] != etag

        weak = client.get("/body1/blob.bin", headers={"Range": "bytes=4000-", "If-Range": f"W/{stale.headers['ETag']}"})
        assert weak.status_code == 200 and weak.content == changed  # If-Range compares strongly


def test_if_range_with_a_date_resumes_only_on_the_exact_last_modified(store: Path):
    with serve_directory(store) as server, httpx.Client(base_url=server.url) as client:
        modified = client.head("/body1/blob.bin").headers["Last-Modified"]
        same = client.get("/body1/blob.bin", headers={"Range": "bytes=0-9", "If-Range": modified})
        assert same.status_code == 206 and same.content == PAYLOAD[:10]
        for other in ("Mon, 01 Jan 2001 00:00:00 GMT", "Fri, 01 Jan 2100 00:00:00 GMT", "not a date"):
            whole = client.get("/body1/blob.bin", headers={"Range": "bytes=0-9", "If-Range": other})
            assert whole.status_code == 200 and whole.content == PAYLOAD, other


def test_if_none_match_answers_304_and_head_answers_headers_only(store: Path):
    with serve_directory(store) as server, httpx.Client(base_url=server.url) as client:
        head = client.head("/body1/blob.bin")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["Content-Length"] == str(len(PAYLOAD)) and head.headers["Accept-Ranges"] == "bytes"
        assert head.headers["ETag"] and head.headers["Last-Modified"]
        for tags in (head.headers["ETag"], f'"other", {head.headers["ETag"]}', "*"):
            same = client.get("/body1/blob.bin", headers={"If-None-Match": tags})
            assert same.status_code == 304 and same.content == b"" and same.headers["ETag"] == head.headers["ETag"]
        assert client.get("/body1/blob.bin", headers={"If-None-Match": '"other"'}).status_code == 200
        ranged_head = client.head("/body1/blob.bin", headers={"Range": "bytes=10-19"})
        assert ranged_head.status_code == 206 and ranged_head.headers["Content-Length"] == "10"
        assert ranged_head.content == b""
        assert server.bytes_sent == len(PAYLOAD)  # the one 200 GET; HEAD and 304 send no body


def test_paths_out_of_the_store_are_refused(tmp_path: Path, store: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for joiners")
    (store / "body1" / "out").symlink_to(secret)
    (store / "body1" / "up").symlink_to(tmp_path)
    (store / "body1" / "same.bin").symlink_to(store / "body1" / "blob.bin")  # inside the store: served
    with serve_directory(store) as server:
        for target in (
            "/../secret.txt",
            "/body1/../../secret.txt",
            "/%2e%2e/secret.txt",
            "/body1/%2E%2E/%2E%2E/secret.txt",
            "/..%2fsecret.txt",
            f"/{secret}",
            f"//{secret}",
            "/body1/out",
            "/body1/up/secret.txt",
            "/body1",
            "/",
            "/body1/missing.bin",
        ):
            status, body = raw_get(server.url, target)
            assert status == 404 and b"not for joiners" not in body, target
        assert raw_get(server.url, "/body1/same.bin") == (200, PAYLOAD)
        assert raw_get(server.url, "/body1/blob.bin?X-Amz-Signature=abc") == (200, PAYLOAD)  # queries are ignored


def test_other_methods_metrics_and_compressed_neighbours(store: Path):
    (store / "body1" / "blob.bin.gz").write_bytes(b"not the file")
    with serve_directory(store) as server, httpx.Client(base_url=server.url) as client:
        posted = client.post("/body1/blob.bin", content=b"x")
        assert posted.status_code in (405, 413) and posted.status_code != 200
        assert client.put("/body1/blob.bin").status_code == 405
        assert client.delete("/body1/blob.bin").status_code == 405
        # A client that accepts gzip still gets the file it asked for, never a .gz next to it.
        plain = client.get("/body1/blob.bin", headers={"Accept-Encoding": "gzip, br"})
        assert plain.content == PAYLOAD and "Content-Encoding" not in plain.headers
        assert "agora_snapshot_bytes_sent_total" in client.get("/metrics").text


def test_over_tls_ranges_and_if_range_hold(tmp_path: Path, store: Path):
    files = make_tls_files(tmp_path / "tls")
    exposure = Exposure(tls=server_tls_context(files.server_cert, files.server_key))
    big = os.urandom(3 << 20)
    (store / "body1" / "big.bin").write_bytes(big)
    with (
        serve_directory(store, exposure=exposure) as server,
        httpx.Client(verify=ssl.create_default_context(cafile=str(files.ca_cert))) as client,
    ):
        assert server.url.startswith("https://127.0.0.1:")
        whole = client.get(f"{server.url}/body1/big.bin")
        assert whole.status_code == 200 and whole.content == big
        resumed = client.get(
            f"{server.url}/body1/big.bin", headers={"Range": "bytes=1000000-", "If-Range": whole.headers["ETag"]}
        )
        assert resumed.status_code == 206 and resumed.content == big[1000000:]
        # Counted when the server's send returns, which can be after the client read the last byte.
        wait_for_count(server, lambda sent: sent >= len(big) + len(big) - 1000000)
        assert server.bytes_sent == len(big) + len(big) - 1000000


def test_a_transfer_cut_by_the_client_counts_what_was_sent(store: Path):
    size = 64 << 20
    with open(store / "body1" / "large.bin", "wb") as out:
        out.truncate(size)
    with serve_directory(store) as server:
        received = 0
        with httpx.Client(timeout=WAIT_S) as client, client.stream("GET", f"{server.url}/body1/large.bin") as reply:
            for block in reply.iter_raw():
                received += len(block)
                if received >= 1 << 20:
                    break
        wait_for_count(server, lambda sent: sent > 0)  # counted once the transfer ends, which the client's close ends
        assert received <= server.bytes_sent < size


def test_clients_that_stop_reading_do_not_hold_up_the_others(store: Path):
    size = 32 << 20
    with open(store / "body1" / "large.bin", "wb") as out:
        out.truncate(size)
    with serve_directory(store) as server:
        address = (urlsplit(server.url).hostname, urlsplit(server.url).port)
        stalled = []
        try:
            for _ in range(48):  # more than the 32 handler threads the server had before it sent with sendfile
                connection = socket.create_connection(address, timeout=WAIT_S)
                connection.sendall(b"GET /body1/large.bin HTTP/1.1\r\nHost: store\r\n\r\n")
                stalled.append(connection)
            for connection in stalled:
                assert connection.recv(12).startswith(b"HTTP/1.1 200")  # each transfer began, then stalled
            started = time.monotonic()
            answer = httpx.get(f"{server.url}/body1/blob.bin", timeout=WAIT_S)
            assert answer.status_code == 200 and answer.content == PAYLOAD
            assert time.monotonic() - started < WAIT_S
        finally:
            for connection in stalled:
                connection.close()
