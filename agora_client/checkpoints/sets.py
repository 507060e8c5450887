"""Consistent checkpoint sets: for a time T, each stage's checkpoint nearest T.

Stages step independently, so there is no global step to checkpoint at; each stage is checkpointed
by wall-clock time and a set takes, per stage, the checkpoint closest to T. Every checkpoint records
the run it belongs to (name, seed, model config): a set mixing runs is refused, and so is resuming a
run config whose model differs from the checkpoints'.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError

from agora_client.config import ModelConfig, RunConfig
from agora_client.snapshots import SnapshotError, SnapshotStore, StoredSnapshot

from .trainer_records import nearest_records

DEFAULT_STORE = "runs/swarm/checkpoints"  # where `agora swarm` checkpoints with its default --run-dir
RUN_KEY = "run"  # manifest section: {"name", "seed", "model"}
TRAINING_KEY = "training"  # manifest section: {"loss", "clip_norm", "last_grad_norm", "period_s"}


class CheckpointError(Exception):
    """A checkpoint set that cannot be used; the message names the stage or file and what to do."""


def run_record(config: RunConfig) -> dict[str, Any]:
    """What a checkpoint records about its run: enough to rebuild every stage (U and E_f come from the seed) and to
    export it with its tokenizer."""
    return {
        "name": config.name,
        "seed": config.seed,
        "model": config.model.model_dump(mode="json"),
        "tokenizer": config.tokenizer.model_dump(mode="json"),
    }


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (UTC unless it says otherwise): ``2026-11-23T16:30:00Z``."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise CheckpointError(
            f"{text!r} is not a time: give unix seconds or ISO 8601 like 2026-11-23T16:30:00Z"
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def format_time(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nearest(snapshots: list[StoredSnapshot], at: float) -> StoredSnapshot | None:
    """The snapshot closest to ``at``; on a tie the later one."""
    return min(snapshots, key=lambda snapshot: (abs(snapshot.timestamp - at), -snapshot.timestamp), default=None)


@dataclass
class CheckpointSet:
    at: float
    members: dict[str, StoredSnapshot]
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected: tuple[str, ...] = ()
    trainers: dict[str, dict[str, Any]] = field(default_factory=dict)  # shard "i/n" -> its record nearest ``at``

    @property
    def missing(self) -> list[str]:
        return [stage for stage in self.expected if stage not in self.members]

    @property
    def loss(self) -> float | None:
        """The loss the tail measured on trainers' batches just before its checkpoint."""
        tail = self.manifests.get("tail", {}).get(TRAINING_KEY, {})
        return tail.get("loss")

    @property
    def eval_loss(self) -> float | None:
        """The trainers' held-out loss near the set's time (mean over the trainers that had evaluated)."""
        losses = [
            record["eval_loss"]
            for record in self.trainers.values()
            if isinstance(record.get("eval_loss"), (int, float))
        ]
        return sum(losses) / len(losses) if losses else None

    def run(self) -> dict[str, Any]:
        """The run every member belongs to; CheckpointError if a stage is missing or members disagree."""
        if self.missing:
            raise CheckpointError(
                f"no checkpoint of stage {', '.join(self.missing)} near {format_time(self.at)}: the set is incomplete; "
                "pick another time (agora checkpoints lists the sets) or restore that stage's files"
            )
        records = {stage: manifest.get(RUN_KEY) for stage, manifest in self.manifests.items()}
        for stage, record in records.items():
            if not isinstance(record, dict) or not {"seed", "model"} <= record.keys():
                raise CheckpointError(
                    f"the {stage} checkpoint {self.members[stage].name} records no run config; "
                    "it was not written as a checkpoint (a joiner snapshot?)"
                )
        # the odd ones out are named against the record most stages share
        keys = {stage: json.dumps(_normalized(record), sort_keys=True) for stage, record in records.items()}
        common = Counter(keys.values()).most_common(1)[0][0]
        reference = next(stage for stage, key in keys.items() if key == common)
        odd = [stage for stage, key in keys.items() if key != common]
        if odd:
            stage = odd[0]
            raise CheckpointError(
                f"the {', '.join(odd)} checkpoint {self.members[stage].name} belongs to another run config than the "
                f"{reference} checkpoint {self.members[reference].name} "
                f"({_difference(records[stage], records[reference])}); "
                "these stages cannot form one model"
            )
        return _normalized(records[reference]) | {"name": records[reference].get("name")}

    def check_config(self, config: RunConfig) -> None:
        """Resuming under ``config`` must rebuild exactly the checkpointed shapes and subspace."""
        record, wanted = self.run(), run_record(config)
        if _normalized(record) != _normalized(wanted):
            raise CheckpointError(
                f"the checkpoints near {format_time(self.at)} come from another run config than {config.name} "
                f"({_difference(record, wanted)}); resume with the run config they were trained with"
            )


def select_set(store: SnapshotStore, at: float | None = None) -> CheckpointSet:
    """Each stage's checkpoint nearest ``at`` (None: each stage's newest), manifests read and checked."""
    listings = {stage: store.list(stage) for stage in store.stages()}
    listings = {stage: snapshots for stage, snapshots in listings.items() if snapshots}
    if not listings:
        raise CheckpointError(f"{store.location} holds no checkpoints")
    if at is None:
        at = max(snapshots[-1].timestamp for snapshots in listings.values())
    return _build_set(store, at, listings)


def list_sets(store: SnapshotStore) -> list[CheckpointSet]:
    """One set per tail checkpoint time (the stage whose loss is recorded), oldest first."""
    listings = {stage: store.list(stage) for stage in store.stages()}
    listings = {stage: snapshots for stage, snapshots in listings.items() if snapshots}
    if not listings:
        return []
    anchor = listings.get("tail") or max(listings.values(), key=len)
    return [_build_set(store, snapshot.timestamp, listings) for snapshot in anchor]


def _build_set(store: SnapshotStore, at: float, listings: dict[str, list[StoredSnapshot]]) -> CheckpointSet:
    members = {stage: found for stage, snapshots in listings.items() if (found := nearest(snapshots, at))}
    manifests = {}
    for stage, snapshot in members.items():
        try:
            manifests[stage] = store.manifest(snapshot)
        except SnapshotError as error:
            raise CheckpointError(f"stage {stage}: {error}") from None
    expected: tuple[str, ...] = tuple(sorted(members))
    for manifest in manifests.values():
        stages = manifest.get(RUN_KEY, {}).get("model", {}).get("stages")
        if isinstance(stages, list):
            expected = tuple(spec["name"] for spec in stages)
            break
    return CheckpointSet(
        at=at, members=members, manifests=manifests, expected=expected, trainers=nearest_records(store, at)
    )


def _normalized(record: dict[str, Any]) -> dict[str, Any]:
    """Seed and model config with defaults filled in, so a field added to ModelConfig later still compares equal."""
    try:
        model = ModelConfig.model_validate(record["model"]).model_dump(mode="json")
    except ValidationError:
        model = record["model"]
    return {"seed": record["seed"], "model": model}


def _difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The first few fields that differ between two run records, as 'field: a vs b'."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    keys = sorted(key for key in flat_a.keys() | flat_b.keys() if key != "name" and flat_a.get(key) != flat_b.get(key))
    return "; ".join(f"{key}: {flat_a.get(key)!r} vs {flat_b.get(key)!r}" for key in keys[:4]) or "same fields"


def _flatten(record: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(record, dict):
        return {prefix: record}
    flat: dict[str, Any] = {}
    for key, value in record.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return flat
