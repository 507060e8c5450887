"""`agora export`: a consistent checkpoint set as one Hugging Face model directory.

The directory holds config.json (Olmo2ForCausalLM), model.safetensors (dense float32 weights), the
byte-level tokenizer files and agora_export.json (which checkpoint each stage came from). It is built
in a temporary sibling directory and renamed into place, so ``--out`` is either complete or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from agora_client.config import ModelConfig
from agora_client.model import StageModule, build_stage
from agora_client.snapshots import SnapshotError, SnapshotStore, load_stage_snapshot, open_store

from .olmo2 import ExportError, olmo2_config, olmo2_state_dict
from .sets import DEFAULT_STORE, CheckpointError, CheckpointSet, format_time, parse_time, select_set
from .tokenizer import BYTES, write_tokenizer


def load_set(store: SnapshotStore, checkpoints: CheckpointSet, cache: Path) -> tuple[ModelConfig, dict[str, StageModule]]:
    """Every stage of the set rebuilt from its run config and loaded (hashes and shapes verified)."""
    run = checkpoints.run()
    config = ModelConfig.model_validate(run["model"])
    modules = {}
    for stage in config.stage_names:
        module = build_stage(config, stage, seed=run["seed"], seeded_weights=False)  # the checkpoint sets every weight
        snapshot = checkpoints.members[stage]
        try:
            load_stage_snapshot(store.local_dir(snapshot, cache), module, stage=stage)
        except SnapshotError as error:
            raise CheckpointError(f"stage {stage}, checkpoint {snapshot.name}: {error}") from None
        modules[stage] = module.eval()
    return config, modules


def export_set(store: SnapshotStore, checkpoints: CheckpointSet, out: Path) -> Path:
    """Write the set as a Hugging Face OLMo2 directory at ``out`` (which must not exist yet)."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose another --out or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # same file system: rename is atomic
    try:
        config, modules = load_set(store, checkpoints, staging / "download")
        if config.vocab_size < BYTES:
            raise CheckpointError(f"vocab_size {config.vocab_size} cannot hold the byte-level tokenizer's {BYTES} tokens")
        try:
            state = olmo2_state_dict(config, modules)
        except ExportError as error:
            raise CheckpointError(str(error)) from None
        shutil.rmtree(staging / "download", ignore_errors=True)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "config.json", olmo2_config(config))
        _write_json(staging / "generation_config.json", {"do_sample": False})
        write_tokenizer(staging, config.seq_len)
        _write_json(staging / "agora_export.json", {
            "at": format_time(checkpoints.at),
            "run": checkpoints.run(),
            "loss": checkpoints.loss,
            "stages": {stage: {"checkpoint": snapshot.name, "time": format_time(snapshot.timestamp), "epoch": snapshot.epoch}
                       for stage, snapshot in checkpoints.members.items()},
        })
        for path in staging.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=DEFAULT_STORE, help=f"checkpoint store: a directory or s3://bucket/prefix (default {DEFAULT_STORE})")
    parser.add_argument("--at", default=None, help="time T (ISO 8601 UTC or unix seconds); default: the newest set")
    parser.add_argument("--out", type=Path, required=True, help="new directory for the Hugging Face model")


def run(args: argparse.Namespace) -> int:
    try:
        store = open_store(args.store)
        checkpoints = select_set(store, None if args.at is None else parse_time(args.at))
        out = export_set(store, checkpoints, args.out)
    except (CheckpointError, SnapshotError) as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    stages = ", ".join(f"{stage} {format_time(snapshot.timestamp)}" for stage, snapshot in checkpoints.members.items())
    print(f"[EXPORT] {out}: Olmo2ForCausalLM from the set at {format_time(checkpoints.at)} ({stages})")
    return 0
