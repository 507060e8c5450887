#!/usr/bin/env python3
"""The resumable, sha256-verifying snapshot download against a plain streaming GET of the same file.

A snapshot store (the project's Range file server, in its own process on 127.0.0.1) serves one stage
snapshot holding a single file of --mb megabytes of random bytes. Alternating, --repeats times each:
- plain: one streaming GET with httpx, every block written to a file (what `curl -o` does);
- ours: `download_snapshot` (manifest, Range-resumable, sha256 checked) into a fresh directory.
Both write to the same file system and delete their file afterwards. Then one download of ours through
a server that cuts the connection once, halfway: the bytes fetched twice measure what a cut costs.

    python bench/download.py            # 500 MB, 3 repeats: ~1 min
    python bench/download.py --mb 100 --repeats 5

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
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
from agora_client.snapshots.server import RangeRequestHandler, serve_directory  # noqa: E402

STAGE, SNAPSHOT = "body1", "00000001-20260101T000000.000000Z"


class CutHalfwayOnce(RangeRequestHandler):
    """Drops the first transfer of the file after half of its bytes (a flag file marks that it happened)."""

    def send_head(self):
        self._body_sent = 0
        return super().send_head()

    def send_body(self, block, outputfile):
        flag = Path(self.directory) / ".cut"
        half = int(flag.with_name(".half").read_text())
        if PARAMS_FILE in self.path and not flag.exists() and self._body_sent + len(block) > half:
            super().send_body(block[: half - self._body_sent], outputfile)
            flag.touch()
            self.close_connection = True
            raise ConnectionAbortedError("bench cut")
        self._body_sent += len(block)
        super().send_body(block, outputfile)


def publish(root: Path, megabytes: int) -> tuple[int, str]:
    """One snapshot of random bytes under root/<stage>/<snapshot>/; returns (size, sha256)."""
    directory = root / STAGE / SNAPSHOT
    directory.mkdir(parents=True)
    digest, size, block = hashlib.sha256(), megabytes << 20, os.urandom(8 << 20)
    with open(directory / PARAMS_FILE, "wb") as out:
        for offset in range(0, size, len(block)):
            piece = block[: min(len(block), size - offset)]
            out.write(piece)
            digest.update(piece)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "stage": STAGE, "epoch": 1, "timestamp": 1.7e9,
                "files": {PARAMS_FILE: {"sha256": digest.hexdigest(), "size": size}}}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    (root / STAGE / LATEST_FILE).write_text(json.dumps({**{k: manifest[k] for k in ("stage", "epoch", "timestamp")},
                                                       "manifest": f"{SNAPSHOT}/{MANIFEST_FILE}"}))
    (root / ".half").write_text(str(size // 2))
    return size, digest.hexdigest()


def _serve(root: Path, handler: type[RangeRequestHandler], conn) -> None:
    server = serve_directory(root, handler=handler)
    conn.send((server.url, os.getpid()))
    conn.recv()  # until the bench is done
    conn.send(server.bytes_sent)
    server.close()


class Store:
    """The file server in its own process, as a real store would be: it does not share our GIL."""

    def __init__(self, root: Path, handler: type[RangeRequestHandler] = RangeRequestHandler):
        context = mp.get_context("fork")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(root, handler, child), daemon=True)
        self._process.start()
        self.url, _ = self._conn.recv()

    def close(self) -> int:
        """Stop the server; returns the body bytes it sent."""
        self._conn.send("stop")
        sent = self._conn.recv() if self._conn.poll(30) else -1
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
        return sent


def plain_get(client: httpx.Client, url: str, path: Path) -> None:
    with client.stream("GET", url) as response, open(path, "wb") as out:
        response.raise_for_status()
        for block in response.iter_bytes():
            out.write(block)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=500, help="size of the snapshot file in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="transfers of each kind, alternated")
    args = parser.parse_args()
    if args.mb < 1 or args.repeats < 1:
        parser.error("--mb and --repeats must be at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="agora-bench-download-"))
    try:
        root = scratch / "store"
        size, sha256 = publish(root, args.mb)
        store = Store(root)
        plain_rates, our_rates = [], []
        latest = f"{store.url}/{STAGE}/{LATEST_FILE}"
        try:
            with httpx.Client(timeout=60) as client:
                for attempt in range(args.repeats):
                    for kind in ("plain", "ours") if attempt % 2 == 0 else ("ours", "plain"):
                        target = scratch / f"{kind}-{attempt}"
                        target.mkdir()
                        started = time.perf_counter()
                        if kind == "plain":
                            plain_get(client, f"{store.url}/{STAGE}/{SNAPSHOT}/{PARAMS_FILE}", target / PARAMS_FILE)
                            plain_rates.append(size / (time.perf_counter() - started))
                        else:
                            download_snapshot(latest, target, events=NULL_WRITER, client=client)
                            our_rates.append(size / (time.perf_counter() - started))
                        print(f"{kind:5s} #{attempt + 1}: {size / (time.perf_counter() - started) / 1e6:7.1f} MB/s", flush=True)
                        shutil.rmtree(target)
        finally:
            store.close()

        cut_store = Store(root, CutHalfwayOnce)
        try:
            target = download_snapshot(latest, scratch / "cut", events=NULL_WRITER, backoff_s=0.05)
            assert (target / PARAMS_FILE).stat().st_size == size
        finally:
            sent = cut_store.close()
        assert (root / ".cut").exists(), "the cut server never cut"
        documents = sum(len((path).read_bytes()) for path in (root / STAGE / LATEST_FILE, root / STAGE / SNAPSHOT / MANIFEST_FILE))
        refetched = sent - size - documents
        print(f"a connection cut at half of {size:,} bytes: {refetched:,} bytes fetched twice")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    plain, ours = statistics.median(plain_rates), statistics.median(our_rates)
    print(f"median: plain GET {plain / 1e6:.1f} MB/s, resumable verified download {ours / 1e6:.1f} MB/s, ratio {ours / plain:.3f}")
    print(json.dumps({
        "bench": "download", "bytes": size, "sha256": sha256[:16], "repeats": args.repeats,
        "plain_get_bps": round(plain), "download_bps": round(ours), "download_over_plain_get": round(ours / plain, 3),
        "cut_refetched_bytes": refetched, "load_avg_1m": os.getloadavg()[0],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
