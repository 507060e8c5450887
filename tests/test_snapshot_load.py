"""Snapshot loads stream tensor by tensor, trust what their download verified, and downloads do not pile up."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from agora_client.auth.client import StageAssignment
from agora_client.config import load_config
from agora_client.events import NULL_WRITER
from agora_client.joining.preparation import StagePreparation
from agora_client.model import build_stage
from agora_client.snapshots import (
    SnapshotError,
    download_marks,
    download_snapshot,
    load_stage_snapshot,
    read_manifest,
    remove_other_downloads,
    save_stage_snapshot,
    serve_directory,
)
from agora_client.snapshots import format as snapshot_format
from agora_client.snapshots.download_marks import MARK_FILE, mark_started
from agora_client.snapshots.tensor_file import TensorFile
from agora_client.worker.optimizer import build_optimizer

CONFIG = load_config("tiny")


def trained_stage(seed: int, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny body1 with OffloadAdamW state after ``steps`` steps."""
    module = build_stage(CONFIG.model, "body1", seed=seed)
    optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], CONFIG)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for parameter in optimizer.param_groups[0]["params"]:
            parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-2
        optimizer.step()
    return module, optimizer


def fresh_stage(seed: int = 5) -> tuple[nn.Module, torch.optim.Optimizer]:
    module = build_stage(CONFIG.model, "body1", seed=seed)
    return module, build_optimizer([p for p in module.parameters() if p.requires_grad], CONFIG)


def whole_file_load(directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What the loader did before it streamed: both files read whole, then handed to load_state_dict."""
    manifest = read_manifest(directory / "manifest.json")
    module.load_state_dict(load_file(str(directory / "params.safetensors")), strict=True)
    meta, state = manifest["optimizer"], {}
    for key, tensor in load_file(str(directory / "optimizer.safetensors")).items():
        _, index, name = key.split(".")
        kind = meta["scalars"].get(key)
        state.setdefault(int(index), {})[name] = (
            {"int": int, "float": float, "bool": bool}[kind](tensor.item()) if kind else tensor
        )
    groups = [
        {name: tuple(value) if isinstance(current.get(name), tuple) else value for name, value in saved.items()}
        for saved, current in zip(meta["param_groups"], optimizer.param_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def assert_same(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    (a_module, a_optimizer), (b_module, b_optimizer) = a, b
    a_params, b_params = a_module.state_dict(), b_module.state_dict()
    assert a_params.keys() == b_params.keys()
    for key, tensor in a_params.items():
        assert torch.equal(tensor, b_params[key]), key
    a_state, b_state = a_optimizer.state_dict(), b_optimizer.state_dict()
    assert a_state["param_groups"] == b_state["param_groups"]
    assert a_state["state"].keys() == b_state["state"].keys()
    for index, entries in a_state["state"].items():
        assert entries.keys() == b_state["state"][index].keys()
        for name, value in entries.items():
            other = b_state["state"][index][name]
            assert type(value) is type(other) and (
                torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            )


@pytest.mark.parametrize("has_state", [False, True], ids=["fresh optimizer", "optimizer with state (a recovery)"])
def test_a_streamed_load_equals_a_whole_file_load(tmp_path: Path, has_state: bool) -> None:
    directory = save_stage_snapshot(tmp_path, "body1", *trained_stage(seed=1, steps=3), epoch=4, keep=1)
    streamed, whole = (
        (trained_stage(seed=9) if has_state else fresh_stage()),
        (trained_stage(seed=9) if has_state else fresh_stage()),
    )
    assert load_stage_snapshot(directory, *streamed, stage="body1").epoch == 4
    whole_file_load(directory, *whole)
    assert_same(streamed, whole)
    # and both go on alike: the streamed optimizer carries the moments and step counts where it keeps them
    for _, optimizer in (streamed, whole):
        for parameter in optimizer.param_groups[0]["params"]:
            parameter.grad = torch.full_like(parameter, 1e-3)
        optimizer.step()
    assert_same(streamed, whole)


def test_a_streamed_load_into_torch_adamw_equals_a_whole_file_load(tmp_path: Path) -> None:
    def adamw(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        return module, torch.optim.AdamW(module.parameters(), lr=1e-2, betas=(0.8, 0.95))

    module, optimizer = adamw(1)
    module(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    directory = save_stage_snapshot(tmp_path, "head", module, optimizer, epoch=2, keep=1)
    streamed, whole = adamw(2), adamw(2)
    load_stage_snapshot(directory, *streamed)
    whole_file_load(directory, *whole)
    assert_same(streamed, whole)
    assert_same(streamed, (module, optimizer))


def test_a_load_reads_every_tensor_once_straight_into_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No file-sized buffer and no per-tensor temporary: each tensor's bytes land in the stage's own tensor."""
    directory = save_stage_snapshot(tmp_path, "body1", *trained_stage(seed=1), epoch=1, keep=1)
    reads: list[tuple[str, int, int]] = []  # (entry, destination address, elements)
    original = TensorFile._read

    def recorded(self, name: str, destination: torch.Tensor) -> None:
        reads.append((name, destination.data_ptr(), destination.numel()))
        original(self, name, destination)

    monkeypatch.setattr(TensorFile, "_read", recorded)
    module, optimizer = fresh_stage()
    load_stage_snapshot(directory, module, optimizer)
    entries = len(load_file(str(directory / "params.safetensors"))) + len(
        load_file(str(directory / "optimizer.safetensors"))
    )
    assert len(reads) == entries and len({name for name, _, _ in reads}) <= entries
    held = {tensor.data_ptr() for tensor in module.state_dict().values()}
    held |= {
        value.data_ptr() for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    }
    assert all(
        address in held for _, address, elements in reads if elements > 1
    )  # only scalars (step) go through a holder


def test_files_verified_by_their_download_are_not_hashed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    published = save_stage_snapshot(tmp_path / "store", "body1", *trained_stage(seed=1), epoch=2, keep=1)
    with serve_directory(tmp_path / "store") as server:
        downloaded = download_snapshot(f"{server.url}/body1/latest.json", tmp_path / "downloads", events=NULL_WRITER)
    hashed: list[Path] = []
    original = snapshot_format.file_sha256
    monkeypatch.setattr(snapshot_format, "file_sha256", lambda path: hashed.append(Path(path)) or original(path))

    load_stage_snapshot(downloaded, *fresh_stage(), stage="body1")
    assert hashed == []
    load_stage_snapshot(published, *fresh_stage(), stage="body1")  # a directory no download verified: hashed
    assert {path.name for path in hashed} == {"params.safetensors", "optimizer.safetensors"}

    params = downloaded / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[-1] ^= 0xFF
    params.write_bytes(bytes(data))  # changed since the download verified it
    with pytest.raises(SnapshotError, match="does not match its sha256"):
        load_stage_snapshot(downloaded, *fresh_stage(), stage="body1")


def test_a_download_mark_is_void_once_a_file_or_the_manifest_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_stage_snapshot(tmp_path / "store", "body1", *trained_stage(seed=1), epoch=2, keep=1)
    with serve_directory(tmp_path / "store") as server:
        downloaded = download_snapshot(f"{server.url}/body1/latest.json", tmp_path / "downloads", events=NULL_WRITER)
    hashed: list[str] = []
    original = snapshot_format.file_sha256
    monkeypatch.setattr(snapshot_format, "file_sha256", lambda path: hashed.append(Path(path).name) or original(path))
    stat = (downloaded / "optimizer.safetensors").stat()
    os.utime(downloaded / "optimizer.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # rewritten in place
    load_stage_snapshot(downloaded, *fresh_stage())
    assert "optimizer.safetensors" in hashed

    hashed.clear()
    mark_started(downloaded)  # a new download into the directory began and did not finish
    load_stage_snapshot(downloaded, *fresh_stage())
    assert sorted(hashed) == ["optimizer.safetensors", "params.safetensors"]


def test_a_download_mark_holds_only_in_the_boot_that_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the downloaded files are not fsynced: after a crash of the machine (a new boot) they may be torn
    boot = tmp_path / "boot_id"
    boot.write_text("first-boot\n")
    monkeypatch.setattr(download_marks, "BOOT_ID_FILE", boot)
    save_stage_snapshot(tmp_path / "store", "body1", *trained_stage(seed=1), epoch=2, keep=1)
    with serve_directory(tmp_path / "store") as server:
        downloaded = download_snapshot(f"{server.url}/body1/latest.json", tmp_path / "downloads", events=NULL_WRITER)
    hashed: list[str] = []
    original = snapshot_format.file_sha256
    monkeypatch.setattr(snapshot_format, "file_sha256", lambda path: hashed.append(Path(path).name) or original(path))
    load_stage_snapshot(downloaded, *fresh_stage())
    assert hashed == []  # the same boot: trusted

    boot.write_text("second-boot\n")
    load_stage_snapshot(downloaded, *fresh_stage())
    assert sorted(hashed) == ["optimizer.safetensors", "params.safetensors"]


def test_only_other_downloads_are_removed(tmp_path: Path) -> None:
    store, downloads = tmp_path / "store", tmp_path / "downloads"
    module, optimizer = trained_stage(seed=1)
    store.mkdir()
    with serve_directory(store) as server:
        fetched = []
        for epoch, stage in ((1, "body1"), (2, "body2"), (3, "body1")):
            save_stage_snapshot(store, stage, module, optimizer, epoch=epoch, keep=1)
            fetched.append(download_snapshot(f"{server.url}/{stage}/latest.json", downloads, events=NULL_WRITER))
    partial = downloads / "body1" / "00000000-20240101T000000.000000Z"  # an interrupted download of ours
    partial.mkdir()
    mark_started(partial)
    (partial / "params.safetensors.part").write_bytes(b"x" * 10)
    own = save_stage_snapshot(downloads / "own", "body1", module, optimizer, epoch=4, keep=1)  # not a download
    published_here = downloads / "body1" / "00000005-20240101T000000.000000Z"  # a snapshot with no mark: not ours
    shutil.copytree(fetched[-1], published_here)
    (published_here / MARK_FILE).unlink()
    (downloads / "body1" / "notes.txt").write_text("the user's")

    assert remove_other_downloads(published_here) == []  # not a download: nothing is touched
    removed = remove_other_downloads(fetched[-1])
    assert sorted(removed) == sorted(path.resolve() for path in (fetched[0], fetched[1], partial))
    assert not any(path.exists() for path in removed)
    assert fetched[-1].is_dir() and (fetched[-1] / MARK_FILE).is_file() and own.is_dir() and published_here.is_dir()
    assert (downloads / "body1" / "notes.txt").is_file()
    load_stage_snapshot(fetched[-1], *fresh_stage())  # the one in use is whole


def test_a_finished_preparation_removes_the_downloads_of_earlier_joins(tmp_path: Path) -> None:
    module, optimizer = trained_stage(seed=1)
    save_stage_snapshot(tmp_path / "store", "body2", module, optimizer, epoch=1, keep=1)
    with serve_directory(tmp_path / "store") as server:
        earlier = download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "downloads", events=NULL_WRITER)
        save_stage_snapshot(tmp_path / "store", "body1", module, optimizer, epoch=2, keep=1)
        preparation = StagePreparation(CONFIG, "cpu", tmp_path / "downloads", NULL_WRITER)
        preparation.start(StageAssignment("body1", f"{server.url}/body1/latest.json"))
        snapshot, prepared = preparation.result(threading.Event())
    assert not earlier.exists() and snapshot.is_dir()
    load_stage_snapshot(snapshot, prepared.module, stage="body1")
