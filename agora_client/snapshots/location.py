"""Which store a location names: ``s3://bucket/prefix`` or a local directory.

The S3 backend (and boto3) is imported only when a location starts with ``s3://``.
"""

from __future__ import annotations

from pathlib import Path

from .format import SnapshotError
from .store import LocalStore, SnapshotStore


def open_store(location: str | Path) -> SnapshotStore:
    """``s3://bucket/prefix`` (endpoint and credentials from the usual AWS_* variables) or a local directory."""
    text = str(location)
    if text.startswith("s3://"):
        try:
            from .s3 import S3Store  # boto3 only for operators who use S3
        except ImportError as error:
            raise SnapshotError(f"{text}: an S3 store needs boto3 ({error}); pip install boto3") from None
        return S3Store(text)
    if "://" in text:
        raise SnapshotError(f"{text} is neither a local directory nor an s3://bucket/prefix location")
    return LocalStore(text)
