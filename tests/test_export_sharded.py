"""The streamed export: sharded safetensors that transformers loads with the unsharded logits, --dtype bf16,
one stage held at a time, and only weight files fetched from the store."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from agora_client.checkpoints import export as export_module
from agora_client.checkpoints import select_set
from agora_client.checkpoints.export import export_set, load_set
from agora_client.checkpoints.olmo2 import olmo2_parameter_count
from agora_client.checkpoints.shards import INDEX_FILE, parse_size
from agora_client.cli import main
from agora_client.snapshots import LocalStore, open_store
from tests.test_checkpoints import CONFIG, T0, full_set

SHARD_LIMIT = 1_000_000  # bytes: the tiny model's 11 MB of float32 weights need a dozen shards


@pytest.fixture
def store(tmp_path) -> LocalStore:
    store = LocalStore(tmp_path / "store")
    full_set(store, T0)
    return store


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            found.update({name: handle.get_tensor(name) for name in handle.keys()})
    return found


def logits(directory: Path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(tokens).logits


def test_a_sharded_export_loads_in_transformers_with_the_unsharded_logits(store, tmp_path):
    chosen = select_set(store)
    export_set(store, chosen, tmp_path / "whole")
    export_set(store, chosen, tmp_path / "sharded", max_shard_bytes=SHARD_LIMIT)
    assert not (tmp_path / "whole" / INDEX_FILE).exists()
    assert [path.name for path in (tmp_path / "whole").glob("model*.safetensors")] == ["model.safetensors"]
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    shards = sorted(path.name for path in (tmp_path / "sharded").glob("model*.safetensors"))
    assert len(shards) > 3 and shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
    ]
    whole, sharded = tensors(tmp_path / "whole"), tensors(tmp_path / "sharded")
    assert set(index["weight_map"]) == set(sharded) == set(whole)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sharded.values())
    assert index["metadata"]["total_size"] == olmo2_parameter_count(CONFIG.model) * 4  # what decides one file or shards
    for shard in shards:  # within the limit, unless one tensor alone is larger
        held = [sharded[name] for name, file in index["weight_map"].items() if file == shard]
        assert sum(t.numel() * t.element_size() for t in held) <= SHARD_LIMIT or len(held) == 1
    for name, tensor in whole.items():
        assert torch.equal(sharded[name], tensor), name
    ours = logits(tmp_path / "whole")
    assert ours.abs().max() > 1.0  # far from uniform: a misplaced tensor would show
    assert torch.equal(logits(tmp_path / "sharded"), ours)


def test_bf16_export_from_the_command_line_holds_bf16_tensors(store, tmp_path):
    base = ["export", "--store", str(store.root), "--out"]
    assert main([*base, str(tmp_path / "fp32")]) == 0
    assert main([*base, str(tmp_path / "bf16"), "--dtype", "bf16", "--max-shard-size", "1MB"]) == 0
    full, half = tensors(tmp_path / "fp32"), tensors(tmp_path / "bf16")
    assert {t.dtype for t in full.values()} == {torch.float32}
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    for name, tensor in full.items():
        assert torch.equal(half[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf16" / "agora_export.json").read_text())["dtype"] == "bf16"
    ours, theirs = logits(tmp_path / "fp32"), logits(tmp_path / "bf16")
    assert (theirs - ours).abs().max() < 0.05 * ours.abs().max()  # rounded weights, the same model


def test_a_bad_shard_size_is_refused_by_name(store, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", "--store", str(store.root), "--out", str(tmp_path / "out"), "--max-shard-size", "5 parsecs"])
    assert "'5 parsecs' is not a size" in capsys.readouterr().err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size("1234") == 1234


def test_each_stage_is_freed_before_the_next_is_loaded(store, tmp_path, monkeypatch):
    loaded: list[weakref.ref] = []
    load = export_module.load_stage_weights

    def tracked(*args, **kwargs):
        alive = [ref().stage for ref in loaded if ref() is not None]
        assert not alive, f"stage {alive} still held while the next one loads"
        module = load(*args, **kwargs)
        loaded.append(weakref.ref(module))
        return module

    gc.disable()  # freed by reference counting alone, not by a collection that happens to run
    try:
        monkeypatch.setattr(export_module, "load_stage_weights", tracked)
        export_set(store, select_set(store), tmp_path / "out", max_shard_bytes=SHARD_LIMIT)
    finally:
        gc.enable()
    assert len(loaded) == len(CONFIG.model.stage_names)


def test_only_the_weight_files_are_fetched_from_a_bucket(tmp_path, request):
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    request.getfixturevalue("s3_endpoint")

    store = open_store(f"s3://agora-test/{request.node.name}")
    full_set(store, T0)
    _, stages = load_set(store, select_set(store), tmp_path / "cache")
    assert set(stages) == set(CONFIG.model.stage_names)
    fetched = {path.name for path in (tmp_path / "cache").rglob("*") if path.is_file()}
    assert fetched == {"params.safetensors", "manifest.json"}
    export_set(store, select_set(store), tmp_path / "hf", max_shard_bytes=SHARD_LIMIT)
    assert (tmp_path / "hf" / INDEX_FILE).is_file()


try:
    from tests.test_s3_store import s3_endpoint  # noqa: E402,F401  the moto S3 server, as a fixture here too
except pytest.skip.Exception:  # no boto3 or moto: the bucket test skips itself
    pass
