"""Download a stage snapshot over HTTP(S): streamed, resumable, verified.

``url`` is a stage's ``latest.json`` or a snapshot's ``manifest.json``. File URLs are the manifest's
per-file ``url`` when present (an object store's presigned URLs, each with its own query string) and
otherwise the file name resolved against the manifest URL (whose query string, valid only for the
manifest itself, is then dropped). Each file is written to ``<name>.part``; an interrupted transfer
resumes with ``Range: bytes=<size of .part>-``; a finished file must match the manifest's sha256
or it is downloaded again from scratch.

At line rate: the sha256 is computed while the bytes stream in, on a thread of its own, a MiB at a time (hashlib
releases the GIL, so hashing overlaps receiving; a resumed file hashes only what is already on disk, once), each
network block goes straight to the file without a copy, and nothing is read back after the transfer.
Once the whole snapshot is verified, the directory's download mark (``download_marks.py``) says so, and a load
in the same boot trusts those files instead of hashing them again; after a reboot it hashes them (the files are
not fsynced: at a small snapshot on a fast link, fsyncs were most of the download's time). The local manifest
is not fsynced either: the mark holds its sha256, so a manifest lost or torn in a crash voids the mark.
``remove_other_downloads`` keeps the disk to the snapshot in use.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from agora_client.events import DownloadEvent, EventWriter
from agora_client.network.outage import OUTAGE_STATUSES, Outage, is_outage, send

from .download_marks import is_download, mark_started, mark_verified
from .durable import write_json
from .format import MANIFEST_FILE, SnapshotError, check_manifest, file_sha256, snapshot_name, snapshot_time

_HASH_BLOCK = 8 << 20  # reading back what a previous run left in a .part file
_HASH_BATCH = 1 << 20  # bytes handed to the hashing thread at a time


class DownloadError(Exception):
    """The snapshot could not be downloaded; the message says why and what to do."""


class _Interrupted(Exception):
    """A transfer that stopped early but may be resumed; ``outage``: the server could not be reached."""

    def __init__(self, message: str, *, outage: bool = False):
        super().__init__(message)
        self.outage = outage


def download_snapshot(
    url: str,
    dest_dir: Path,
    *,
    events: EventWriter,
    client: httpx.Client | None = None,
    max_retries: int = 5,
    backoff_s: float = 0.5,
    max_corrupt_retries: int = 2,
    progress_every_s: float = 0.25,
    timeout_s: float = 30.0,
    outage: Outage | None = None,
) -> Path:
    """Download the snapshot into ``dest_dir/<stage>/<epoch>-<time>/`` and return that directory.

    DownloadEvents: ``started`` per file (``resumed_from`` = bytes already there), ``progress`` at most
    every ``progress_every_s`` (``bytes`` / ``total`` count the whole snapshot), ``retry`` with the reason,
    ``verified`` per file, then ``done``; ``failed`` before DownloadError. Files already complete and
    verified in the destination are not fetched again. ``max_retries`` bounds consecutive interruptions
    without progress (waiting ``backoff_s`` doubled each time); ``max_corrupt_retries`` bounds re-downloads
    after a sha256 mismatch. With ``outage``, a server that cannot be reached is waited for instead
    (network/outage.py), the bytes received kept.
    """
    own_client = client is None
    http = client or httpx.Client(timeout=timeout_s, follow_redirects=True)
    try:
        manifest, manifest_url = _fetch_manifest(http, url, max_retries, backoff_s, outage)
        target = Path(dest_dir) / manifest["stage"] / snapshot_name(manifest["epoch"], manifest["timestamp"])
        target.mkdir(parents=True, exist_ok=True)
        mark_started(target)
        progress = _Progress(events, sum(entry["size"] for entry in manifest["files"].values()), progress_every_s)
        for name, entry in manifest["files"].items():
            file_url = entry.get("url") or urljoin(manifest_url, name)
            fetcher = _FileFetch(http, file_url, target / name, entry, progress, outage)
            fetcher.run(max_retries, backoff_s, max_corrupt_retries)
        local = {
            **manifest,
            "files": {name: {"sha256": e["sha256"], "size": e["size"]} for name, e in manifest["files"].items()},
        }
        # without per-file URLs: presigned signatures stay off disk; not fsynced (the mark holds its sha256)
        write_json(target / MANIFEST_FILE, local, sync=False)
        mark_verified(target, MANIFEST_FILE, list(manifest["files"]))
        progress.done(f"snapshot of {manifest['stage']} at epoch {manifest['epoch']} ready in {target}")
        return target
    except DownloadError as error:
        events.emit(DownloadEvent(status="failed", message=str(error)))
        raise
    finally:
        if own_client:
            http.close()


def remove_other_downloads(in_use: Path) -> list[Path]:
    """Remove every snapshot directory downloaded beside ``in_use`` (complete or partial), keeping ``in_use``;
    return the removed ones. Only directories a download of ours made are touched (they carry its mark and a
    snapshot's name, under ``<download root>/<stage>/``); nothing at all when ``in_use`` is not one of them.
    Best effort, never raising: what cannot be removed or read is left (the next call tries again)."""
    in_use = Path(in_use).resolve()
    removed: list[Path] = []
    try:
        if not is_download(in_use):
            return removed
        for directory in sorted(in_use.parent.parent.glob("*/*")):
            if directory == in_use or directory.is_symlink() or not directory.is_dir():
                continue
            if snapshot_time(directory.name) is not None and is_download(directory):
                shutil.rmtree(directory, ignore_errors=True)  # a stale download thread may still write into it
                removed.append(directory)
    except OSError:
        pass  # an unreadable download root: nothing more to remove safely
    return removed


class _Progress:
    """Whole-snapshot byte counts and rate; throttles progress events."""

    def __init__(self, events: EventWriter, total: int, every_s: float):
        self.events = events
        self.total = total
        self.every_s = every_s
        self.completed = 0  # bytes of finished files
        self.current = 0  # bytes of the file in flight
        self.transferred = 0  # bytes received over the network in this call
        self.started = time.monotonic()
        self.last_emit = 0.0
        self.file = ""
        self.resumed_from = 0

    @property
    def bytes(self) -> int:
        return self.completed + self.current

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.transferred / elapsed if elapsed > 0 else 0.0

    def eta(self) -> float | None:
        rate = self.rate()
        return (self.total - self.bytes) / rate if rate > 0 else None

    def emit(self, status: str, message: str = "") -> None:
        self.events.emit(
            DownloadEvent(
                status=status,
                file=self.file,
                bytes=self.bytes,
                total=self.total,
                rate_bps=self.rate(),
                eta_s=self.eta(),
                resumed_from=self.resumed_from,
                message=message,
            )
        )

    def file_started(self, name: str, offset: int) -> None:
        self.file, self.current, self.resumed_from = name, offset, offset
        self.emit("started", f"resuming {name} at byte {offset}" if offset else f"downloading {name}")

    def received(self, count: int) -> None:
        self.current += count
        self.transferred += count
        now = time.monotonic()
        if now - self.last_emit >= self.every_s:
            self.last_emit = now
            self.emit("progress")

    def file_done(self, name: str, size: int, message: str) -> None:
        self.file, self.current = name, 0
        self.completed += size
        self.emit("verified", message)

    def done(self, message: str) -> None:
        self.file = ""
        self.emit("done", message)


class _FileFetch:
    def __init__(
        self,
        http: httpx.Client,
        url: str,
        path: Path,
        entry: dict[str, Any],
        progress: _Progress,
        outage: Outage | None = None,
    ):
        self.http, self.url, self.path, self.progress, self.outage = http, url, path, progress, outage
        self.name = path.name
        self.size: int = entry["size"]
        self.sha256: str = entry["sha256"]
        self.part = path.with_name(path.name + ".part")
        self._hasher = _Hasher()  # sha256 of the first _hasher.count bytes of .part

    def run(self, max_retries: int, backoff_s: float, max_corrupt_retries: int) -> None:
        try:
            self._fetch(max_retries, backoff_s, max_corrupt_retries)
        finally:
            self._hasher.close()  # its thread ends with the file, however the file ends

    def _fetch(self, max_retries: int, backoff_s: float, max_corrupt_retries: int) -> None:
        if self.path.is_file() and self.path.stat().st_size == self.size and file_sha256(self.path) == self.sha256:
            self.progress.file_done(self.name, self.size, f"{self.name} already downloaded and verified")
            return
        self.path.unlink(missing_ok=True)
        failures = corrupt = 0
        while True:
            offset = self.part.stat().st_size if self.part.exists() else 0
            if offset > self.size:
                self.part.unlink()
                offset = 0
            if offset < self.size or not self.part.exists():
                try:
                    self._transfer(offset)
                except _Interrupted as error:
                    reached = self.part.stat().st_size if self.part.exists() else 0
                    failures = 0 if reached > offset else failures + 1
                    self._wait_to_resume(error, failures, max_retries, backoff_s)
                    self.progress.emit("retry", f"{self.name}: {error}; resuming at byte {reached}")
                    continue
            self._hash_part_up_to(self.size)
            digest = self._hasher.hexdigest()
            if digest == self.sha256:
                os.replace(self.part, self.path)
                self.progress.file_done(self.name, self.size, f"{self.name} verified (sha256 {digest[:12]})")
                return
            corrupt += 1
            self._discard_corrupt_part(digest, corrupt, max_corrupt_retries)

    def _wait_to_resume(self, error: _Interrupted, failures: int, max_retries: int, backoff_s: float) -> None:
        """Wait before resuming: through an outage of the server when there is an Outage, else ``backoff_s`` doubled
        per interruption without progress; DownloadError once that is over."""
        if error.outage and self.outage is not None:
            if self.outage.wait():
                return
        elif failures <= max_retries:
            time.sleep(backoff_s * 2 ** max(0, failures - 1))
            return
        raise DownloadError(
            f"downloading {self.name} from {_shown(self.url)} failed {failures} times in a row ({error}); check "
            "your connection and start again: the bytes already received are kept"
        )

    def _discard_corrupt_part(self, digest: str, corrupt: int, max_corrupt_retries: int) -> None:
        """Drop a .part that failed its sha256 check, to download it again; DownloadError once it happened too often."""
        self.part.unlink()
        self._hasher = _Hasher()
        if corrupt > max_corrupt_retries:
            raise DownloadError(
                f"{self.name} from {_shown(self.url)} failed its sha256 check {corrupt} times: the snapshot store "
                "serves a damaged file; tell the swarm operator"
            )
        self.progress.current = 0
        self.progress.emit(
            "retry",
            f"sha256 mismatch for {self.name} (expected {self.sha256[:12]}, got {digest[:12]}): downloading it again",
        )

    def _hash_part_up_to(self, offset: int) -> None:
        """Make _hasher cover the first ``offset`` bytes of .part: kept across retries, rebuilt after a restart."""
        if self._hasher.count == offset:
            return
        self._hasher.close()
        self._hasher = _Hasher()
        with open(self.part, "rb") as handle:
            while self._hasher.count < offset and (block := handle.read(min(_HASH_BLOCK, offset - self._hasher.count))):
                self._hasher.update(block)

    def _transfer(self, offset: int) -> None:
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            with self.http.stream("GET", self.url, headers=headers) as response:
                mode = self._write_mode(response, offset)
                if self.outage is not None:
                    self.outage.ended()
                if mode == "wb":
                    offset = 0
                    self._hasher.close()
                    self._hasher = _Hasher()
                else:
                    self._hash_part_up_to(offset)
                self.progress.file_started(self.name, offset)
                remaining = self.size - offset
                # unbuffered: each network block is written and hashed as it is, without a copy; the body is read
                # to its end, so that the connection serves the next file
                with open(self.part, mode, buffering=0) as out:
                    for block in response.iter_raw():
                        longer = len(block) > remaining
                        if longer:
                            block = block[:remaining]  # never store more than the manifest promises
                        _write_all(out, block)
                        self._hasher.update(block)
                        remaining -= len(block)
                        self.progress.received(len(block))
                        if longer:
                            break  # a body longer than the file: its connection is dropped, its excess unread
        except httpx.TransportError as error:
            raise _Interrupted(f"connection lost ({type(error).__name__})", outage=is_outage(error)) from None
        if remaining > 0:
            raise _Interrupted(f"the server ended the transfer {remaining} bytes early")

    def _write_mode(self, response: httpx.Response, offset: int) -> str:
        status = response.status_code
        if status == 206 and offset and response.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
            return "ab"
        if status == 200 or status == 206 and not offset:
            return "wb"  # a server that ignores Range sends the whole file
        if status == 416:
            self.part.unlink(missing_ok=True)
            raise _Interrupted("the server refused to resume this file; starting it over")
        if status in (408, 429) or status >= 500:
            raise _Interrupted(f"the server answered HTTP {status}", outage=status in OUTAGE_STATUSES)
        hint = " (an expired presigned URL? ask for a fresh snapshot URL)" if status in (401, 403) else ""
        raise DownloadError(f"{_shown(self.url)} answered HTTP {status}{hint}")


def _fetch_manifest(
    http: httpx.Client, url: str, max_retries: int, backoff_s: float, outage: Outage | None
) -> tuple[dict[str, Any], str]:
    document = _get_json(http, url, max_retries, backoff_s, outage)
    if isinstance(document, dict) and "files" not in document and isinstance(document.get("manifest"), str):
        url = urljoin(url, document["manifest"])  # latest.json -> the newest snapshot's manifest
        document = _get_json(http, url, max_retries, backoff_s, outage)
    try:
        return check_manifest(document, _shown(url)), url
    except SnapshotError as error:
        raise DownloadError(str(error)) from None


def _get_json(http: httpx.Client, url: str, max_retries: int, backoff_s: float, outage: Outage | None) -> Any:
    failures = 0
    while True:
        try:
            response = send(outage, lambda: http.get(url))
            break
        except httpx.TransportError as error:
            failures += 1
            if failures > max_retries:
                raise DownloadError(
                    f"could not reach {_shown(url)} ({type(error).__name__}); check the snapshot URL and "
                    "your connection"
                ) from None
            time.sleep(backoff_s * 2 ** (failures - 1))
    if response.status_code != 200:
        hint = " (an expired presigned URL?)" if response.status_code in (401, 403) else ""
        raise DownloadError(f"{_shown(url)} answered HTTP {response.status_code}{hint}; check the snapshot URL")
    try:
        return response.json()
    except ValueError:
        raise DownloadError(f"{_shown(url)} is not JSON: expected a snapshot manifest or latest.json") from None


class _Hasher:
    """sha256 of a stream of blocks; ``count`` is the bytes handed over so far.

    Blocks are gathered into batches of ``_HASH_BATCH`` and hashed by a thread of its own (hashlib releases the GIL,
    so hashing overlaps receiving); a stream shorter than one batch is hashed at the end by the caller, without a
    thread. Handing over every 64 KiB network block instead cost more in thread handoffs than hashing it."""

    def __init__(self) -> None:
        self.count = 0
        self._digest = hashlib.sha256()
        self._batch: list[bytes] = []
        self._batch_bytes = 0
        self._batches: queue.Queue[bytes | None] = queue.Queue(maxsize=8)  # bounds memory if hashing falls behind
        self._thread: threading.Thread | None = None

    def update(self, block: bytes) -> None:
        self._batch.append(block)
        self._batch_bytes += len(block)
        self.count += len(block)
        if self._batch_bytes >= _HASH_BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
            self._thread.start()
        self._batches.put(b"".join(self._batch))
        self._batch, self._batch_bytes = [], 0

    def _run(self) -> None:
        while (batch := self._batches.get()) is not None:
            self._digest.update(batch)

    def close(self) -> None:
        """Wait until every block handed over is hashed."""
        if self._thread is None:
            for block in self._batch:
                self._digest.update(block)
        else:
            if self._batch:
                self._hand_over()
            self._batches.put(None)
            self._thread.join()
            self._thread = None
        self._batch, self._batch_bytes = [], 0

    def hexdigest(self) -> str:
        self.close()
        return self._digest.hexdigest()


def _write_all(out: Any, block: bytes) -> None:
    view = memoryview(block)  # an unbuffered write may take less than the whole block
    while view:
        view = view[out.write(view) :]


def _shown(url: str) -> str:
    """The URL without its query string, which for a presigned URL is a credential."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"
