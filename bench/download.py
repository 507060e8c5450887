#!/usr/bin/env python3
"""The resumable, sha256-verifying snapshot download against a plain streaming GET of the same file.

A snapshot store (the project's Range file server, in its own process on 127.0.0.1) serves one stage
snapshot holding a single file of --mb MiB of random bytes. Alternating, --repeats times each:
- plain: one streaming GET with httpx, every block written to a file (what `curl -o` does);
- ours: `download_snapshot` (manifest, Range-resumable, sha256 checked) into a fresh directory.
Both write to the same file system and delete their file afterwards. Two links: the bare loopback
(gigabytes per second: there the CPU binds, and hashing competes with receiving for the machine's
cores) and a store paced to --line-mbit (a fast home or datacenter line). Then one download of ours
through a store that cuts the connection once, halfway: the bytes fetched twice measure what a cut costs.
The paced and the cutting stores are the server behind a front in its process (``tests/store_front.py``): the
server sends with sendfile, so pacing and cuts happen in a front that forwards its bytes.

    python bench/download.py            # 500 MiB, 3 repeats per link: ~2 min
    python bench/download.py --mb 100 --repeats 5 --line-mbit 500

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from agora_client.events import NULL_WRITER  # noqa: E402
from agora_client.snapshots import download_snapshot  # noqa: E402
from agora_client.snapshots.format import FORMAT, FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, PARAMS_FILE  # noqa: E402
from agora_client.snapshots.server import serve_directory  # noqa: E402
from tests.store_front import StoreFront  # noqa: E402

STAGE, SNAPSHOT = "body1", "00000001-20260101T000000.000000Z"


class PacedStore(StoreFront):
    """A front to the store that passes each response body on at no more than ``rate`` bytes per second."""

    rate = 1.0  # set before the store's process is forked

    async def relay_body(self, target, blocks, send):
        started, sent = time.monotonic(), 0
        async for block in blocks:
            await send(block)
            sent += len(block)
            await asyncio.sleep(max(0.0, started + sent / self.rate - time.monotonic()))


class CutHalfwayOnce(StoreFront):
    """A front to the store that drops the first transfer of the snapshot file after ``half`` of its bytes."""

    half = 0  # set before the store's process is forked
    cut = False

    async def relay_body(self, target, blocks, send):
        if PARAMS_FILE not in target or CutHalfwayOnce.cut:
            return await super().relay_body(target, blocks, send)
        sent = 0
        async for block in blocks:
            if sent + len(block) > self.half:
                await send(block[: self.half - sent])
                CutHalfwayOnce.cut = True
                raise ConnectionAbortedError("bench cut")
            await send(block)
            sent += len(block)


def publish(root: Path, megabytes: int) -> int:
    """One snapshot of random bytes under root/<stage>/<snapshot>/; returns its size."""
    directory = root / STAGE / SNAPSHOT
    directory.mkdir(parents=True)
    digest, size, block = hashlib.sha256(), megabytes << 20, os.urandom(8 << 20)
    with open(directory / PARAMS_FILE, "wb") as out:
        for offset in range(0, size, len(block)):
            piece = block[: min(len(block), size - offset)]
            out.write(piece)
            digest.update(piece)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "stage": STAGE,
        "epoch": 1,
        "timestamp": 1.7e9,
        "files": {PARAMS_FILE: {"sha256": digest.hexdigest(), "size": size}},
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    (root / STAGE / LATEST_FILE).write_text(
        json.dumps(
            {**{k: manifest[k] for k in ("stage", "epoch", "timestamp")}, "manifest": f"{SNAPSHOT}/{MANIFEST_FILE}"}
        )
    )
    return size


def _serve(root: Path, front: type[StoreFront] | None, conn) -> None:
    server = serve_directory(root)
    served = front(server.url) if front is not None else server
    conn.send(served.url)
    conn.recv()  # until the bench is done
    conn.send((served.bytes_sent, getattr(front, "cut", None)))
    if front is not None:
        served.close()
    server.close()


class Store:
    """The file server in its own process, as a real store would be: it does not share our GIL. With ``front`` (paced or
    cutting) the bench talks to that front, in the same process, which forwards to the server."""

    def __init__(self, root: Path, front: type[StoreFront] | None):
        context = mp.get_context("fork")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(root, front, child), daemon=True)
        self._process.start()
        self.url = self._conn.recv()

    def close(self) -> tuple[int, bool | None]:
        """Stop the server; returns the body bytes it sent and whether it cut a transfer."""
        self._conn.send("stop")
        result = self._conn.recv() if self._conn.poll(30) else (-1, None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
        return result


def plain_get(client: httpx.Client, url: str, path: Path) -> None:
    with client.stream("GET", url) as response, open(path, "wb") as out:
        response.raise_for_status()
        for block in response.iter_bytes():
            out.write(block)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=500, help="size of the snapshot file in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="transfers of each kind per link, alternated")
    parser.add_argument("--line-mbit", type=float, default=1000.0, help="the paced store's rate in Mbit/s")
    args = parser.parse_args()
    if args.mb < 1 or args.repeats < 1 or args.line_mbit <= 0:
        parser.error("--mb, --repeats and --line-mbit must be positive")
    scratch = Path(tempfile.mkdtemp(prefix="agora-bench-download-"))
    links: dict[str, dict] = {}
    try:
        root = scratch / "store"
        size = publish(root, args.mb)
        for link, rate in (("loopback", None), (f"{args.line_mbit:g}mbit", args.line_mbit * 1e6 / 8)):
            if rate is not None:
                PacedStore.rate = rate
            store = Store(root, PacedStore if rate is not None else None)
            try:
                links[link] = compare(store.url, scratch, size, args.repeats, link)
            finally:
                store.close()

        CutHalfwayOnce.half = size // 2
        cut_store = Store(root, CutHalfwayOnce)
        try:
            target = download_snapshot(
                f"{cut_store.url}/{STAGE}/{LATEST_FILE}", scratch / "cut", events=NULL_WRITER, backoff_s=0.05
            )
            assert (target / PARAMS_FILE).stat().st_size == size
        finally:
            sent, was_cut = cut_store.close()
        assert was_cut, "the cut store never cut"
        documents = sum(
            path.stat().st_size for path in (root / STAGE / LATEST_FILE, root / STAGE / SNAPSHOT / MANIFEST_FILE)
        )
        refetched = sent - size - documents
        print(f"a connection cut at half of {size:,} bytes: {refetched:,} bytes fetched twice")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(
        json.dumps(
            {
                "bench": "download",
                "bytes": size,
                "repeats": args.repeats,
                **{f"{link}_{key}": value for link, figures in links.items() for key, value in figures.items()},
                "cut_refetched_bytes": refetched,
                "cpus": os.cpu_count(),
                "load_avg_1m": os.getloadavg()[0],
            }
        )
    )
    return 0


def compare(url: str, scratch: Path, size: int, repeats: int, link: str) -> dict:
    """Median rates of plain GETs and of our download, alternated."""
    rates: dict[str, list[float]] = {"plain": [], "ours": []}
    with httpx.Client(timeout=60) as client:
        for attempt in range(repeats):
            for kind in ("plain", "ours") if attempt % 2 == 0 else ("ours", "plain"):
                target = scratch / f"{kind}-{attempt}"
                target.mkdir()
                started = time.perf_counter()
                if kind == "plain":
                    plain_get(client, f"{url}/{STAGE}/{SNAPSHOT}/{PARAMS_FILE}", target / PARAMS_FILE)
                else:
                    download_snapshot(f"{url}/{STAGE}/{LATEST_FILE}", target, events=NULL_WRITER, client=client)
                rates[kind].append(size / (time.perf_counter() - started))
                print(f"{link:>9s} {kind:5s} #{attempt + 1}: {rates[kind][-1] / 1e6:7.1f} MB/s", flush=True)
                shutil.rmtree(target)
    plain, ours = statistics.median(rates["plain"]), statistics.median(rates["ours"])
    print(
        f"{link:>9s} median: plain GET {plain / 1e6:.1f} MB/s, resumable verified download {ours / 1e6:.1f} MB/s, "
        f"ratio {ours / plain:.3f}",
        flush=True,
    )
    return {
        "plain_get_bps": round(plain),
        "download_bps": round(ours),
        "download_over_plain_get": round(ours / plain, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
