#!/usr/bin/env python3
"""The snapshot server before and after it moved to aiohttp's FileResponse (sendfile), under a wave of joiners.

Each server runs in its own process on 127.0.0.1 over one file of --gb GB (random bytes, in the page cache).
--clients resumable downloads start at once, from client processes (--procs) beside it, each from an address of
its own (127.0.x.y, so the per-address connection cap does not bind): a client fetches the first quarter with a
Range request, then resumes on the same connection with ``Range: bytes=<quarter>-`` and ``If-Range: <ETag>``,
and drops every byte it receives. A 503 (the old server's handler pool full) is retried after its Retry-After,
as the downloader does. Figures per server: total body bytes/s over the wave, and the p99 of time to first byte
(from a request's first attempt to the first byte of its answer; both requests of every client).

The old server is not in the product any more: it is read from git (commit OLD_COMMIT, the old server and the
HTTP front it ran on) into a temporary package.

    python3 bench/snapshot_server.py                      # 200 clients x 2 GB: minutes per server on 2 cores
    python3 bench/snapshot_server.py --clients 20 --gb 0.2

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agora_client.snapshots.server import serve_directory  # noqa: E402

OLD_COMMIT = "d316867"
FILE_NAME = "snapshot.bin"
RECV_BLOCK = 1 << 20


def load_old_server(scratch: Path):
    """The hand-made server of OLD_COMMIT and its HTTP front, as modules under ``scratch``."""
    package = scratch / "_old_http_service"
    package.mkdir()
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", OLD_COMMIT, "agora_client/http_service/"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for path in listing:
        (package / Path(path).name).write_text(_git_show(path))
    server = _git_show("agora_client/snapshots/server.py")
    (scratch / "_old_snapshot_server.py").write_text(
        server.replace("from agora_client.http_service import", "from _old_http_service import")
    )
    sys.path.insert(0, str(scratch))
    return importlib.import_module("_old_snapshot_server")


def _git_show(path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _serve(which: str, root: Path, scratch: Path, conn) -> None:
    serve = load_old_server(scratch).serve_directory if which == "old" else serve_directory
    server = serve(root)
    conn.send(server.url)
    conn.recv()
    conn.send(server.bytes_sent)
    server.close()


async def _request(address, local: str, head: bytes, started: float) -> tuple[socket.socket, bytes, float, bytes]:
    """Send ``head`` until an answer other than 503: (socket, answer head, time to first byte, body bytes so far)."""
    loop = asyncio.get_running_loop()
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.bind((local, 0))
        try:
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, head)
            received = await loop.sock_recv(sock, 65536)
            first = time.perf_counter() - started
            while b"\r\n\r\n" not in received:
                more = await loop.sock_recv(sock, 65536)
                if not more:
                    raise ConnectionResetError("closed in the answer's head")
                received += more
        except OSError:  # refused by a connection cap: a joiner tries again
            sock.close()
            await asyncio.sleep(1.0)
            continue
        headers, _, body = received.partition(b"\r\n\r\n")
        if headers.startswith(b"HTTP/1.1 503"):
            sock.close()
            await asyncio.sleep(1.0)  # the old server's Retry-After
            continue
        return sock, headers, first, body


async def _one_client(address, local: str, size: int, etag: str, results: list) -> None:
    loop = asyncio.get_running_loop()
    buffer = bytearray(RECV_BLOCK)
    quarter = size // 4
    sock = None
    for extra in (f"Range: bytes=0-{quarter - 1}\r\n", f"Range: bytes={quarter}-\r\nIf-Range: {etag}\r\n"):
        head = f"GET /{FILE_NAME} HTTP/1.1\r\nHost: store\r\n{extra}\r\n".encode()
        started = time.perf_counter()
        if sock is not None:  # the resume goes on the same keep-alive connection when the server kept it
            try:
                await loop.sock_sendall(sock, head)
                received = await loop.sock_recv(sock, 65536)
                while b"\r\n\r\n" not in received:
                    more = await loop.sock_recv(sock, 65536)
                    if not more:
                        raise ConnectionResetError
                    received += more
                first = time.perf_counter() - started
                headers, _, body = received.partition(b"\r\n\r\n")
            except OSError:
                sock.close()
                sock = None
        if sock is None or headers.startswith(b"HTTP/1.1 503"):
            sock, headers, first, body = await _request(address, local, head, started)
        if not headers.startswith(b"HTTP/1.1 206"):
            raise RuntimeError(f"expected 206, got {headers.splitlines()[0]!r}")
        length = int(next(line for line in headers.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
        got = len(body)
        while got < length:
            count = await loop.sock_recv_into(sock, memoryview(buffer)[: min(RECV_BLOCK, length - got)])
            if not count:
                raise RuntimeError("the server closed the connection mid-body")
            got += count
        results.append((first, got))
    sock.close()


def _client_process(address, locals_: list[str], size: int, etag: str, conn) -> None:
    async def run() -> list:
        results: list = []
        await asyncio.gather(*(_one_client(address, local, size, etag, results) for local in locals_))
        return results

    conn.recv()  # start together
    conn.send(asyncio.run(run()))


def wave(url: str, clients: int, procs: int, size: int, etag: str) -> dict:
    parts = urlsplit(url)
    address = (parts.hostname, parts.port)
    locals_ = [f"127.0.{1 + index // 250}.{1 + index % 250}" for index in range(clients)]
    context = mp.get_context("fork")
    pipes, processes = [], []
    for share in range(procs):
        mine, theirs = context.Pipe()
        process = context.Process(
            target=_client_process, args=(address, locals_[share::procs], size, etag, theirs), daemon=True
        )
        process.start()
        pipes.append(mine)
        processes.append(process)
    started = time.perf_counter()
    for pipe in pipes:
        pipe.send("go")
    results = [item for pipe in pipes for item in pipe.recv()]
    elapsed = time.perf_counter() - started
    for process in processes:
        process.join(30)
    firsts = sorted(first for first, _ in results)
    total = sum(got for _, got in results)
    if total != clients * size:
        raise RuntimeError(f"received {total:,} bytes, expected {clients * size:,}")
    return {
        "bytes_per_s": round(total / elapsed),
        "ttfb_p99_s": round(firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))], 3),
        "ttfb_p50_s": round(statistics.median(firsts), 3),
        "seconds": round(elapsed, 1),
    }


def publish(root: Path, size: int) -> None:
    block = os.urandom(8 << 20)
    with open(root / FILE_NAME, "wb") as out:
        for offset in range(0, size, len(block)):
            out.write(block[: min(len(block), size - offset)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="resumable downloads at once")
    parser.add_argument("--gb", type=float, default=2.0, help="size of the snapshot file in GB (1e9 bytes)")
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    args = parser.parse_args()
    if not 1 <= args.clients <= 250 * 250 or args.gb <= 0 or args.procs < 1:
        parser.error("--clients 1..62500, a positive --gb and at least one --procs")
    size = int(args.gb * 1e9)
    scratch = Path(tempfile.mkdtemp(prefix="agora-bench-snapshot-server-"))
    figures: dict[str, dict] = {}
    try:
        root = scratch / "store"
        root.mkdir()
        publish(root, size)
        facts = os.stat(root / FILE_NAME)
        etag = f'"{facts.st_mtime_ns:x}-{facts.st_size:x}"'  # the same scheme in both servers
        for which in ("old", "new"):
            (scratch / which).mkdir()
            context = mp.get_context("fork")
            conn, child = context.Pipe()
            server = context.Process(target=_serve, args=(which, root, scratch / which, child), daemon=True)
            server.start()
            url = conn.recv()
            try:
                figures[which] = wave(url, args.clients, args.procs, size, etag)
            finally:
                conn.send("stop")
                figures.setdefault(which, {})["server_bytes_sent"] = conn.recv() if conn.poll(60) else None
                server.join(30)
            print(f"{which}: {json.dumps(figures[which])}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    old, new = figures["old"], figures["new"]
    print(
        json.dumps(
            {
                "bench": "snapshot_server",
                "clients": args.clients,
                "bytes": size,
                **{f"{which}_{key}": value for which, row in figures.items() for key, value in row.items()},
                "throughput_new_over_old": round(new["bytes_per_s"] / old["bytes_per_s"], 3),
                "ttfb_p99_old_over_new": round(old["ttfb_p99_s"] / max(new["ttfb_p99_s"], 1e-6), 2),
                "cpus": os.cpu_count(),
                "load_avg_1m": os.getloadavg()[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
