"""Which checkpoints a store keeps: every one while young, then one per hour, then one per day."""

from __future__ import annotations

from dataclasses import dataclass

from agora_client.config import CheckpointConfig
from agora_client.snapshots import StoredSnapshot

HOUR, DAY = 3600.0, 86400.0


@dataclass(frozen=True)
class Retention:
    """A KeepPolicy: all checkpoints younger than ``keep_all_s``; the newest of each UTC hour up to
    ``keep_hourly_s``; the newest of each UTC day beyond. The newest checkpoint is always kept."""

    keep_all_s: float = DAY
    keep_hourly_s: float = 7 * DAY

    @classmethod
    def from_config(cls, config: CheckpointConfig) -> "Retention":
        return cls(config.keep_all_s, config.keep_hourly_s)

    def __call__(self, snapshots: list[StoredSnapshot], now: float) -> set[str]:
        keep: set[str] = set()
        newest_in_bucket: dict[tuple[str, int], StoredSnapshot] = {}
        for snapshot in snapshots:
            age = now - snapshot.timestamp
            if age < self.keep_all_s:
                keep.add(snapshot.name)
                continue
            bucket = (
                ("hour", int(snapshot.timestamp // HOUR))
                if age < self.keep_hourly_s
                else ("day", int(snapshot.timestamp // DAY))
            )
            if bucket not in newest_in_bucket or snapshot.timestamp > newest_in_bucket[bucket].timestamp:
                newest_in_bucket[bucket] = snapshot
        keep.update(snapshot.name for snapshot in newest_in_bucket.values())
        if snapshots:
            keep.add(max(snapshots).name)
        return keep
