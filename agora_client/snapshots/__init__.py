"""Stage snapshots: the on-disk format, a Range-capable HTTP file server, and the resumable download."""

from .download import DownloadError, download_snapshot
from .format import (
    SnapshotError,
    SnapshotInfo,
    latest_snapshot,
    load_stage_snapshot,
    read_manifest,
    save_stage_snapshot,
)
from .server import RangeRequestHandler, SnapshotServer, serve_directory

__all__ = [
    "DownloadError", "RangeRequestHandler", "SnapshotError", "SnapshotInfo", "SnapshotServer", "download_snapshot",
    "latest_snapshot", "load_stage_snapshot", "read_manifest", "save_stage_snapshot", "serve_directory",
]
