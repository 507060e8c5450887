"""Stage snapshots: the on-disk format, where they are stored (local directory or S3), a Range-capable
HTTP file server (sendfile on aiohttp), and the resumable download."""

from .download import DownloadError, download_snapshot, remove_other_downloads
from .format import (
    SnapshotError,
    SnapshotInfo,
    latest_snapshot,
    load_stage_snapshot,
    read_manifest,
)
from .location import open_store
from .server import SnapshotServer, serve_directory
from .store import KeepPolicy, LocalStore, SnapshotStore, StoredSnapshot, keep_newest, save_stage_snapshot

__all__ = [
    "DownloadError",
    "KeepPolicy",
    "LocalStore",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotServer",
    "SnapshotStore",
    "StoredSnapshot",
    "download_snapshot",
    "keep_newest",
    "latest_snapshot",
    "load_stage_snapshot",
    "open_store",
    "read_manifest",
    "remove_other_downloads",
    "save_stage_snapshot",
    "serve_directory",
]
