"""`agora export`: a consistent checkpoint set as one Hugging Face model directory, streamed stage by stage.

The directory holds config.json (Olmo2ForCausalLM), the dense weights in safetensors shards (``model.safetensors``,
or ``model-0000N-of-0000M.safetensors`` plus ``model.safetensors.index.json`` above the shard size), the run's
tokenizer (the very tokenizer.json the trainers used, with its tokenizer_config.json) and agora_export.json (which
checkpoint each stage came from). Only each stage's weights file is fetched; one stage at a time is loaded, folded
into OLMo2 tensors and written, so the host holds at most the largest stage plus one shard. The directory is built
in a temporary sibling and renamed into place, so ``--out`` is either complete or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from agora_client.config import ConfigError, ModelConfig, RunConfig, TokenizerConfig, parse_config
from agora_client.data.tokenizer import (
    RunTokenizer,
    TokenizerError,
    describe_tokenizer,
    load_run_tokenizer,
    tokenizer_config_json,
)
from agora_client.model import StageModule
from agora_client.snapshots import SnapshotError, SnapshotStore, open_store

from .olmo2 import ExportError, check_layers, olmo2_config, olmo2_parameter_count, olmo2_stage_tensors
from .sets import DEFAULT_STORE, RUN_KEY, CheckpointError, CheckpointSet, format_time, parse_time, select_set
from .shards import DEFAULT_MAX_SHARD_BYTES, ShardWriter, parse_size, release_freed_memory
from .stage_weights import load_stage_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_DTYPE = "fp32"  # lossless: the trained float32 weights as they are; bf16 (half the bytes) is a choice


def set_run_config(checkpoints: CheckpointSet) -> RunConfig:
    """The set's run as a RunConfig: its name, seed, model and tokenizer (a record without one: the byte-level
    tokenizer, as before runs named theirs). Data and evaluation are not recorded: they keep their defaults."""
    run = checkpoints.run()  # the members agree on seed and model
    tokenizers = {
        stage: TokenizerConfig.model_validate(manifest[RUN_KEY].get("tokenizer", {}))
        for stage, manifest in checkpoints.manifests.items()
    }
    tokenizer = tokenizers[checkpoints.expected[0]]
    odd = [stage for stage, other in tokenizers.items() if other != tokenizer]
    if odd:
        raise CheckpointError(
            f"the {', '.join(odd)} checkpoint records the tokenizer {tokenizers[odd[0]].model_dump()} but the "
            f"{checkpoints.expected[0]} checkpoint {tokenizer.model_dump()}: these stages were not trained "
            "on the same tokens"
        )
    try:
        return parse_config(
            {
                "name": run["name"],
                "seed": run["seed"],
                "model": run["model"],
                "tokenizer": tokenizer.model_dump(mode="json"),
            }
        )
    except ConfigError as error:
        raise CheckpointError(f"the checkpoints' run record is not a valid run config: {error}") from None


def load_set(store: SnapshotStore, checkpoints: CheckpointSet, cache: Path) -> tuple[RunConfig, dict[str, StageModule]]:
    """The set's run config and every stage of the set loaded at once, from its weights file (hashes and shapes
    verified). For comparing an export with the stages it came from; the export itself holds one stage at a time."""
    run = set_run_config(checkpoints)
    return run, {
        stage: load_stage_weights(store, checkpoints.members[stage], run.model, run.seed, cache)
        for stage in run.model.stage_names
    }


def export_tokenizer(run: RunConfig) -> RunTokenizer:
    """The run's tokenizer, loaded and checked as the trainers load it (sha256 pin, vocabulary size)."""
    try:
        return load_run_tokenizer(run)
    except TokenizerError as error:
        raise CheckpointError(f"cannot export with the run's tokenizer: {error}") from None


def write_tokenizer(directory: Path, tokenizer: RunTokenizer, model_max_length: int) -> None:
    """tokenizer.json byte for byte as the trainers read it, and transformers' tokenizer_config.json beside it."""
    (directory / "tokenizer.json").write_bytes(tokenizer.content)
    (directory / "tokenizer_config.json").write_text(
        tokenizer_config_json(tokenizer, model_max_length), encoding="utf-8"
    )


def write_weights(
    store: SnapshotStore,
    checkpoints: CheckpointSet,
    config: ModelConfig,
    directory: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
) -> None:
    """Each stage in turn: fetch its weights, fold them into OLMo2 tensors in ``dtype``, write them to shards."""
    seed, cache = checkpoints.run()["seed"], directory / "download"
    shards = ShardWriter(directory, max_shard_bytes)
    one_file = olmo2_parameter_count(config) * dtype.itemsize <= max_shard_bytes
    layers: list[int] = []
    try:
        for stage in config.stage_names:
            module = load_stage_weights(store, checkpoints.members[stage], config, seed, cache)
            shutil.rmtree(cache, ignore_errors=True)  # a downloaded weights file is read once
            for name, tensor in olmo2_stage_tensors(config, module, dtype):
                shards.add(name, tensor)
            layers += [int(index) for index in module.layers]
            del module  # before the next stage loads
            if one_file:
                release_freed_memory()  # what the stage held: the one shard keeps only its own tensors
            else:  # the stage's last shard too (handing its memory back): the next load never meets a held shard
                shards.flush()
        check_layers(config, layers)
    except ExportError as error:
        raise CheckpointError(str(error)) from None
    shards.finish()


def export_set(
    store: SnapshotStore,
    checkpoints: CheckpointSet,
    out: Path,
    *,
    dtype: str = DEFAULT_DTYPE,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the set as a Hugging Face OLMo2 directory at ``out`` (which must not exist yet), weights in ``dtype``
    (a key of DTYPES) and in shards of at most ``max_shard_bytes`` (a larger single tensor gets a shard alone)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose another --out or remove it first")
    run = set_run_config(checkpoints)
    tokenizer = export_tokenizer(run)  # before anything is written: a tokenizer that cannot load fails the export
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # same file system: rename is atomic
    try:
        config = run.model
        write_weights(store, checkpoints, config, staging, DTYPES[dtype], max_shard_bytes)
        eos = _eos_token_id(tokenizer)
        _write_json(staging / "config.json", olmo2_config(config, DTYPES[dtype], eos))
        # pad = eos: generate() pads finished sequences of a batch with it (OLMo2's own generation config has one)
        _write_json(staging / "generation_config.json", {"do_sample": False, "eos_token_id": eos, "pad_token_id": eos})
        write_tokenizer(staging, tokenizer, config.seq_len)
        _write_json(staging / "agora_export.json", _export_record(checkpoints, tokenizer, dtype))
        _fsync_files(staging)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _export_record(checkpoints: CheckpointSet, tokenizer: RunTokenizer, dtype: str) -> dict:
    """agora_export.json: the checkpoint set the directory holds (time, run, loss, dtype, each stage's file)."""
    return {
        "at": format_time(checkpoints.at),
        "run": checkpoints.run() | {"tokenizer": describe_tokenizer(tokenizer)},
        "loss": checkpoints.loss,
        "dtype": dtype,
        "stages": {
            stage: {
                "checkpoint": snapshot.name,
                "time": format_time(snapshot.timestamp),
                "epoch": snapshot.epoch,
            }
            for stage, snapshot in checkpoints.members.items()
        },
    }


def _fsync_files(directory: Path) -> None:
    """Flush every file of ``directory`` to disk, so the rename that publishes it never shows a partial file."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _eos_token_id(tokenizer: RunTokenizer) -> int | None:
    """The id that ends a document, where the tokenizer has one.

    The byte-level one ends documents with a blank line."""
    return None if tokenizer.eos_token is None else tokenizer.backend.token_to_id(tokenizer.eos_token)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        default=DEFAULT_STORE,
        help=f"checkpoint store: a directory or s3://bucket/prefix (default {DEFAULT_STORE})",
    )
    parser.add_argument("--at", default=None, help="time T (ISO 8601 UTC or unix seconds); default: the newest set")
    parser.add_argument("--out", type=Path, required=True, help="new directory for the Hugging Face model")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_DTYPE,
        help=f"weight dtype (default {DEFAULT_DTYPE}: the trained float32 weights unchanged, which bf16 "
        "cannot give back; bf16 halves the files and the memory to serve them)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="SIZE",
        help="largest safetensors shard, e.g. 5GB (the default, as transformers) or 500MB",
    )


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    try:
        store = open_store(args.store)
        checkpoints = select_set(store, None if args.at is None else parse_time(args.at))
        out = export_set(store, checkpoints, args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_size)
    except (CheckpointError, SnapshotError) as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    stages = ", ".join(f"{stage} {format_time(snapshot.timestamp)}" for stage, snapshot in checkpoints.members.items())
    shards = len(list(out.glob("model*.safetensors")))
    tokenizer = set_run_config(checkpoints).tokenizer.source
    print(
        f"[EXPORT] {out}: Olmo2ForCausalLM in {args.dtype}, {shards} shard(s), tokenizer {tokenizer}, "
        f"from the set at {format_time(checkpoints.at)} ({stages})"
    )
    return 0
