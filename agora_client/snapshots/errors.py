"""The one error of the snapshots package."""


class SnapshotError(Exception):
    """A snapshot that cannot be written or used; the message names the file and the mismatch."""
