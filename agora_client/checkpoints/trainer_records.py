"""Trainers' records in the checkpoint store: where each trainer's data stands, and its held-out loss, by time.

A trainer writes ``trainers/<i>-of-<n>-<unix ms>.json`` every ``checkpoint.period_s``: its data position (see
``agora_client.data.stream``), the microbatches it has sent, and its newest eval loss. A checkpoint set takes,
per trainer, the record nearest its time, so a resumed swarm continues every trainer's data where the set's
model had it, and ``agora checkpoints`` lists the eval loss per set. Records follow the stages' retention.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Any

from agora_client.config import RunConfig
from agora_client.snapshots import SnapshotError, SnapshotStore, StoredSnapshot
from agora_client.snapshots.store import TRAINERS_DIR

from .retention import Retention

RECORD_NAME = re.compile(r"^(\d+)-of-(\d+)-(\d+)\.json$")


def save_trainer_record(
    store: SnapshotStore,
    config: RunConfig,
    *,
    shard: str,
    microbatches: int,
    position: dict[str, Any],
    eval_loss: float | None,
    timestamp: float | None = None,
) -> str:
    """Write one record, then drop this trainer's records the retention policy no longer keeps; returns its key."""
    timestamp = time.time() if timestamp is None else timestamp
    index, count = shard.split("/")
    key = f"{TRAINERS_DIR}/{index}-of-{count}-{int(timestamp * 1000)}.json"
    store.put_record(
        key,
        {
            "timestamp": timestamp,
            "shard": shard,
            "microbatches": microbatches,
            "eval_loss": eval_loss,
            "run": config.name,
            "position": position,
        },
    )
    keep = Retention.from_config(config.checkpoint)
    records = _listing(store).get(shard, [])
    kept = keep(records, timestamp)
    for record in records:
        if record.name not in kept:
            store.remove_record(f"{TRAINERS_DIR}/{record.name}")
    return key


def nearest_records(store: SnapshotStore, at: float) -> dict[str, dict[str, Any]]:
    """Per trainer shard (``0/2``), its record nearest ``at`` (on a tie the later one)."""
    found = {}
    for shard, records in _listing(store).items():
        nearest = min(records, key=lambda record: (abs(record.timestamp - at), -record.timestamp))
        try:
            found[shard] = store.get_record(f"{TRAINERS_DIR}/{nearest.name}")
        except SnapshotError:
            continue  # a damaged record: that trainer starts its data afresh, and the set says so
    return found


def _listing(store: SnapshotStore) -> dict[str, list[StoredSnapshot]]:
    """Per shard, its records as StoredSnapshots (time, shard, name), oldest first."""
    by_shard: dict[str, list[StoredSnapshot]] = defaultdict(list)
    for name in store.record_names(TRAINERS_DIR):
        if matched := RECORD_NAME.match(name):
            shard = f"{matched[1]}/{matched[2]}"
            by_shard[shard].append(StoredSnapshot(int(matched[3]) / 1000, shard, name))
    return {shard: sorted(records) for shard, records in by_shard.items()}
