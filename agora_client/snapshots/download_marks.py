"""The mark a snapshot download leaves in its directory: which directories we downloaded, and whether their files
were verified against the manifest while they streamed in (so a load need not hash them again).

The mark holds the sha256 of the manifest and each file's size and modification time at verification; a file
replaced or rewritten since then, or another manifest, makes the mark void and the loader hashes again.

It also holds the kernel's boot id, and is trusted only in the boot that wrote it: what a process wrote survives
that process's crash (the page cache keeps it), and only a crash of the machine, which starts a new boot, can tear
a file. So the files need no fsync before the mark, which at a small snapshot on a fast link was most of the
download's time. Where the kernel gives no boot id, the files are fsynced first and the mark holds in any boot.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .durable import fsync_file, write_json

# A dot name: never a snapshot file (a manifest refuses such names), never served as one.
MARK_FILE = ".agora-download.json"
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def mark_started(directory: Path) -> None:
    """Say that ``directory`` is a download of ours, not yet verified (voids an earlier verification). Not fsynced:
    ``is_download`` needs only the mark's name, which a journaling file system keeps whenever it keeps the files
    created after it; a crash that lost it leaves the directory to its user, and never makes another's ours. On a
    busy disk its fsyncs cost more than a small snapshot's whole transfer."""
    write_json(Path(directory) / MARK_FILE, {"verified": None}, sync=False)


def mark_verified(directory: Path, manifest_name: str, file_names: list[str]) -> None:
    """Record that the files and the manifest in ``directory`` are verified, in this boot (without a boot id: the
    files fsynced first). The mark itself is not fsynced: lost in a crash, it only makes the load hash the files
    again (the started mark still says the directory is ours)."""
    directory = Path(directory)
    boot, files = boot_id(), {}
    for name in file_names:
        if boot is None:
            fsync_file(directory / name)
        files[name] = _fingerprint(directory / name)
    manifest_sha256 = hashlib.sha256((directory / manifest_name).read_bytes()).hexdigest()
    verified = {"manifest_sha256": manifest_sha256, "files": files, "boot": boot}
    write_json(directory / MARK_FILE, {"verified": verified}, sync=False)


def is_download(directory: Path) -> bool:
    return (Path(directory) / MARK_FILE).is_file()


def verified_by_download(directory: Path, manifest_name: str, files: dict[str, Any]) -> bool:
    """Whether the download verified exactly this manifest and these files (``files``: the manifest's entries)."""
    directory = Path(directory)
    try:
        mark = json.loads((directory / MARK_FILE).read_text(encoding="utf-8"))
        manifest_sha256 = hashlib.sha256((directory / manifest_name).read_bytes()).hexdigest()
    except (OSError, ValueError):
        return False
    verified = mark.get("verified") if isinstance(mark, dict) else None
    if not isinstance(verified, dict) or verified.get("manifest_sha256") != manifest_sha256:
        return False
    if verified.get("boot") not in (None, boot_id()):  # written in an earlier boot, its files never fsynced
        return False
    recorded = verified.get("files")
    if not isinstance(recorded, dict) or set(recorded) != set(files):
        return False
    for name, entry in files.items():
        try:
            fingerprint = _fingerprint(directory / name)
        except OSError:
            return False
        if fingerprint != recorded[name] or fingerprint[0] != entry["size"]:
            return False
    return True


def _fingerprint(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def boot_id() -> str | None:
    """The running kernel's boot id (Linux), new at every boot; None where there is none."""
    try:
        return BOOT_ID_FILE.read_text(encoding="ascii").strip() or None
    except OSError:
        return None
