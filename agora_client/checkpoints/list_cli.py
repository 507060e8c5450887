"""`agora checkpoints`: the consistent checkpoint sets in a store.

Per-stage times, the loss and eval loss around each."""

from __future__ import annotations

import argparse
import json
import sys

from agora_client.snapshots import SnapshotError, open_store

from .sets import DEFAULT_STORE, CheckpointError, CheckpointSet, format_time, list_sets, parse_time, select_set


def describe_set(checkpoints: CheckpointSet) -> dict:
    return {
        "at": format_time(checkpoints.at),
        "loss": checkpoints.loss,
        "eval_loss": checkpoints.eval_loss,
        "trainers": {
            shard: {"time": format_time(record["timestamp"]), "microbatches": record.get("microbatches")}
            for shard, record in sorted(checkpoints.trainers.items())
        },
        "missing": checkpoints.missing,
        "stages": {
            stage: {
                "checkpoint": snapshot.name,
                "time": format_time(snapshot.timestamp),
                "epoch": snapshot.epoch,
                "offset_s": round(snapshot.timestamp - checkpoints.at, 3),
            }
            for stage, snapshot in checkpoints.members.items()
        },
    }


def format_set(info: dict) -> str:
    loss = "n/a" if info["loss"] is None else f"{info['loss']:.4f}"
    eval_loss = "n/a" if info["eval_loss"] is None else f"{info['eval_loss']:.4f}"
    state = f"incomplete: no {', '.join(info['missing'])}" if info["missing"] else "complete"
    lines = [f"T = {info['at']}  loss {loss}  eval {eval_loss}  {state}"]
    for stage, member in info["stages"].items():
        lines.append(f"    {stage:<8}{member['time']}  ({member['offset_s']:+.1f}s)  epoch {member['epoch']}")
    for shard, record in info["trainers"].items():
        lines.append(f"    trainer {shard}  data position at {record['time']}, {record['microbatches']} microbatches")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", default=DEFAULT_STORE, help=f"a directory or s3://bucket/prefix (default {DEFAULT_STORE})"
    )
    parser.add_argument("--at", default=None, help="show only the set nearest this time (ISO 8601 UTC or unix seconds)")
    parser.add_argument("--json", action="store_true", help="one JSON object per set")


def run(args: argparse.Namespace) -> int:
    try:
        store = open_store(args.store)
        sets = [select_set(store, parse_time(args.at))] if args.at else list_sets(store)
    except (CheckpointError, SnapshotError) as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    if not sets:
        print(f"no checkpoints in {store.location}")
        return 0
    for checkpoints in sets:
        info = describe_set(checkpoints)
        print(json.dumps(info) if args.json else format_set(info))
    return 0
