"""Where stage snapshots live: a local directory (served by ``server.py``) or an S3-compatible bucket.

Both hold the same layout (see ``format.py``): ``<stage>/<epoch>-<UTC time>/{params,optimizer}.safetensors``,
its ``manifest.json`` written last, and ``<stage>/latest.json``. A snapshot counts as present once its
manifest is, so a reader never sees half of one. Beside the stages, ``trainers/`` holds small JSON records
(``put_record``: the trainers' data positions and eval losses, see checkpoints/trainer_records.py).
``location.open_store`` picks the backend from the location.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .format import (
    LATEST_FILE,
    MANIFEST_FILE,
    SnapshotError,
    StageState,
    cpu_state,
    fsync_dir,
    read_manifest,
    snapshot_name,
    snapshot_time,
    write_json,
    write_state_files,
)


@dataclass(frozen=True, order=True)
class StoredSnapshot:
    """One complete snapshot in a store, known from its name alone (no manifest read)."""

    timestamp: float
    stage: str
    name: str

    @property
    def epoch(self) -> int:
        return int(self.name.split("-", 1)[0])


TRAINERS_DIR = "trainers"  # trainers' records (data positions, eval losses) beside the stages' folders
ABANDONED_STAGING_S = 3600.0  # a staging directory nothing was written to for this long belongs to a writer that died

# Given a stage's snapshots (oldest first) and the time now, the names to keep.
KeepPolicy = Callable[[list[StoredSnapshot], float], set[str]]


def keep_newest(count: int) -> KeepPolicy:
    if count < 1:
        raise SnapshotError(f"keep must be at least 1 (got {count}): the snapshot just written is always kept")
    return lambda snapshots, now: {snapshot.name for snapshot in snapshots[-count:]}


class SnapshotStore(ABC):
    """A place for stage snapshots; ``location`` is what ``open_store`` was given."""

    location: str

    def save(
        self,
        stage: str,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        epoch: int,
        *,
        extra: dict[str, Any] | None = None,
        timestamp: float | None = None,
    ) -> StoredSnapshot:
        """Write a snapshot of a stage nothing else is changing (a worker writes its host copy: ``save_state``)."""
        return self.save_state(stage, cpu_state(module, optimizer), epoch, extra=extra, timestamp=timestamp)

    def save_state(
        self,
        stage: str,
        state: StageState,
        epoch: int,
        *,
        extra: dict[str, Any] | None = None,
        timestamp: float | None = None,
    ) -> StoredSnapshot:
        """Write a snapshot of a state already taken into a staging directory, which becomes the snapshot (uploaded,
        if remote) only once complete: a write that fails leaves the store as it was."""
        timestamp = time.time() if timestamp is None else timestamp
        name = snapshot_name(epoch, timestamp)
        staging = self._staging_dir(stage, name)
        try:
            write_state_files(staging, stage, state, epoch, timestamp=timestamp, extra=extra)
            self._commit(stage, name, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return StoredSnapshot(snapshot_time(name) or timestamp, stage, name)

    def prune(self, stage: str, policy: KeepPolicy, now: float | None = None) -> list[StoredSnapshot]:
        """Remove the stage's snapshots the policy does not keep (never the newest); returns the removed ones."""
        snapshots = self.list(stage)
        if not snapshots:
            return []
        now = time.time() if now is None else now
        keep = policy(snapshots, now) | {snapshots[-1].name}
        removed = [snapshot for snapshot in snapshots if snapshot.name not in keep]
        for snapshot in removed:
            self.remove(snapshot)
        directory, prefix = self._staging_place(stage)
        remove_abandoned_staging(directory, prefix, now)
        return removed

    @abstractmethod
    def stages(self) -> list[str]:
        """Stage names that hold at least one object."""

    @abstractmethod
    def put_record(self, key: str, data: dict[str, Any]) -> None:
        """Write one small JSON record at ``key`` (``folder/name.json``) in one step.

        Readers see all of it or nothing."""

    @abstractmethod
    def get_record(self, key: str) -> dict[str, Any]:
        """A record written by ``put_record``; SnapshotError if it is missing or damaged."""

    @abstractmethod
    def record_names(self, folder: str) -> list[str]:
        """The names of the records in ``folder``, sorted."""

    @abstractmethod
    def remove_record(self, key: str) -> None: ...

    @abstractmethod
    def list(self, stage: str) -> list[StoredSnapshot]:
        """The stage's complete snapshots, oldest first."""

    @abstractmethod
    def manifest(self, snapshot: StoredSnapshot) -> dict[str, Any]:
        """The snapshot's checked manifest."""

    @abstractmethod
    def local_dir(self, snapshot: StoredSnapshot, cache: Path, files: Collection[str] | None = None) -> Path:
        """A local directory holding the snapshot's files (downloaded under ``cache`` if remote); not yet verified.

        ``files`` names the only ones needed (an export reads the weights, not the optimizer state); None: all."""

    @abstractmethod
    def remove(self, snapshot: StoredSnapshot) -> None: ...

    def _staging_dir(self, stage: str, name: str) -> Path:
        directory, prefix = self._staging_place(stage)
        directory.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{name}-", dir=directory))

    @abstractmethod
    def _staging_place(self, stage: str) -> tuple[Path, str]:
        """Where a snapshot of ``stage`` is written before its commit: a directory, and its entries' name prefix."""

    @abstractmethod
    def _commit(self, stage: str, name: str, staging: Path) -> None:
        """Make the files in ``staging`` the snapshot ``stage/name`` (manifest last), then point latest.json at it."""


class LocalStore(SnapshotStore):
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.location = str(self.root)

    def stages(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_dir() and not entry.name.startswith(".") and entry.name != TRAINERS_DIR
        )

    def put_record(self, key: str, data: dict[str, Any]) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, data, compact=True)

    def get_record(self, key: str) -> dict[str, Any]:
        try:
            data = json.loads((self.root / key).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise SnapshotError(f"the record {self.root / key} is unreadable ({type(error).__name__})") from None
        if not isinstance(data, dict):
            raise SnapshotError(f"the record {self.root / key} is not a JSON object")
        return data

    def record_names(self, folder: str) -> list[str]:
        directory = self.root / folder
        if not directory.is_dir():
            return []
        return sorted(entry.name for entry in directory.iterdir() if entry.suffix == ".json" and entry.is_file())

    def remove_record(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def list(self, stage: str) -> list[StoredSnapshot]:
        stage_dir = self.root / stage
        if not stage_dir.is_dir():
            return []
        found = []
        for entry in stage_dir.iterdir():
            moment = snapshot_time(entry.name)
            if moment is not None and (entry / MANIFEST_FILE).is_file():
                found.append(StoredSnapshot(moment, stage, entry.name))
        return sorted(found)

    def path(self, snapshot: StoredSnapshot) -> Path:
        return self.root / snapshot.stage / snapshot.name

    def manifest(self, snapshot: StoredSnapshot) -> dict[str, Any]:
        return read_manifest(self.path(snapshot) / MANIFEST_FILE)

    def local_dir(self, snapshot: StoredSnapshot, cache: Path, files: Collection[str] | None = None) -> Path:
        return self.path(snapshot)

    def remove(self, snapshot: StoredSnapshot) -> None:
        shutil.rmtree(self.path(snapshot), ignore_errors=True)  # another publisher may have pruned it already

    def _staging_place(self, stage: str) -> tuple[Path, str]:
        return self.root / stage, ".tmp-"  # the same file system: the commit's rename is atomic

    def _commit(self, stage: str, name: str, staging: Path) -> None:
        stage_dir = self.root / stage
        os.rename(staging, stage_dir / name)
        fsync_dir(stage_dir)
        latest = {
            "stage": stage,
            "epoch": int(name.split("-", 1)[0]),
            "timestamp": snapshot_time(name),
            "manifest": f"{name}/{MANIFEST_FILE}",
        }
        write_json(stage_dir / LATEST_FILE, latest)


def remove_abandoned_staging(directory: Path, prefix: str, now: float) -> None:
    """Remove the staging directories in ``directory`` (names starting with ``prefix``) that nothing was written to
    for ABANDONED_STAGING_S: a writer killed mid-write leaves its staging behind, as large as a snapshot."""
    for entry in directory.glob(f"{prefix}*") if directory.is_dir() else ():
        try:
            last_write = max([entry.stat().st_mtime, *(path.stat().st_mtime for path in entry.iterdir())])
        except (FileNotFoundError, NotADirectoryError):  # committed or removed meanwhile, or not a staging directory
            continue
        if now - last_write > ABANDONED_STAGING_S:
            shutil.rmtree(entry, ignore_errors=True)


def save_stage_snapshot(
    root: Path, stage: str, module: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, keep: int
) -> Path:
    """Write one snapshot under ``root/stage`` and keep the newest ``keep``; returns the snapshot directory."""
    policy = keep_newest(keep)
    store = LocalStore(root)
    written = store.save(stage, module, optimizer, epoch)
    store.prune(stage, policy)
    return store.path(written)
