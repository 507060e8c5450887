"""Stage snapshots: format round trip, the Range file server, and the resumable verified download."""

from __future__ import annotations

import io
import json
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from agora_client.events import DownloadEvent, EventWriter, parse_event
from agora_client.snapshots import (
    DownloadError,
    SnapshotError,
    download_snapshot,
    latest_snapshot,
    load_stage_snapshot,
    save_stage_snapshot,
    serve_directory,
)
from tests.store_front import StoreFront

CHUNK = 64 * 1024  # one network block: a cut connection must cost less than this
# the optimizer file (3.3 MB) spans several of the download's 1 MiB hashing batches, the parameters file 1.6 MB
PUBLISHED_WIDTH = 640


class TinyStage(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 8)
        self.register_buffer("scale", torch.ones(width))  # persistent: saved
        self.register_buffer("rope_cache", torch.randn(width), persistent=False)  # frozen, rebuilt: not saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inner(x) * self.scale + self.rope_cache))


def trained(seed: int, width: int = 32, steps: int = 3) -> tuple[TinyStage, torch.optim.AdamW]:
    torch.manual_seed(seed)
    module = TinyStage(width)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05)
    for _ in range(steps):
        step(module, optimizer, seed)
    return module, optimizer


def step(module: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    width = module.inner.in_features
    loss = module(torch.randn(16, width, generator=generator)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def fresh(seed: int = 99, width: int = 32) -> tuple[TinyStage, torch.optim.AdamW]:
    torch.manual_seed(seed)
    module = TinyStage(width)
    return module, torch.optim.AdamW(module.parameters(), lr=1.0, betas=(0.5, 0.5))


def assert_same_state(a_module, a_opt, b_module, b_opt) -> None:
    a_params, b_params = a_module.state_dict(), b_module.state_dict()
    assert a_params.keys() == b_params.keys()
    for key in a_params:
        assert torch.equal(a_params[key], b_params[key]), key
    a_state, b_state = a_opt.state_dict(), b_opt.state_dict()
    assert a_state["param_groups"] == b_state["param_groups"]
    assert a_state["state"].keys() == b_state["state"].keys()
    for index, entries in a_state["state"].items():
        assert entries.keys() == b_state["state"][index].keys()
        for name, value in entries.items():
            assert torch.equal(value, b_state["state"][index][name]), (index, name)


def events_of(buffer: io.StringIO) -> list[DownloadEvent]:
    return [parse_event(line) for line in buffer.getvalue().splitlines()]


# -- format ---------------------------------------------------------------------------------------------


def test_round_trip_gives_identical_params_and_optimizer_state(tmp_path: Path):
    module, optimizer = trained(seed=1)
    directory = save_stage_snapshot(tmp_path, "body1", module, optimizer, epoch=7, keep=3)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["stage"] == "body1" and manifest["epoch"] == 7
    assert set(manifest["files"]) == {"params.safetensors", "optimizer.safetensors"}
    assert manifest["optimizer"]["param_groups"][0]["betas"] == [0.8, 0.95]
    assert "rope_cache" not in manifest["params"] and "scale" in manifest["params"]
    assert not any(path.suffix in (".pt", ".pkl", ".bin") for path in directory.iterdir())

    restored, restored_opt = fresh()
    rope_before = restored.rope_cache.clone()
    info = load_stage_snapshot(directory, restored, restored_opt, stage="body1")
    assert (info.epoch, info.stage) == (7, "body1") and info.timestamp == manifest["timestamp"]
    assert_same_state(module, optimizer, restored, restored_opt)
    assert isinstance(restored_opt.param_groups[0]["betas"], tuple)
    assert torch.equal(restored.rope_cache, rope_before)  # non-persistent buffer untouched

    # Both continue identically: the restored optimizer really carries the moments and step count.
    restored.rope_cache.copy_(module.rope_cache)
    step(module, optimizer, seed=5)
    step(restored, restored_opt, seed=5)
    assert_same_state(module, optimizer, restored, restored_opt)


def test_keeps_last_k_and_latest_points_at_newest(tmp_path: Path):
    module, optimizer = trained(seed=2)
    written = [save_stage_snapshot(tmp_path, "head", module, optimizer, epoch=epoch, keep=2) for epoch in range(4)]
    remaining = sorted(entry.name for entry in (tmp_path / "head").iterdir() if entry.is_dir())
    assert remaining == sorted(path.name for path in written[-2:])
    assert latest_snapshot(tmp_path / "head") == written[-1]
    latest = json.loads((tmp_path / "head" / "latest.json").read_text())
    assert latest["epoch"] == 3 and latest["manifest"] == f"{written[-1].name}/manifest.json"
    assert not [entry for entry in (tmp_path / "head").iterdir() if entry.name.startswith(".")]


def test_load_refuses_mismatches_without_touching_the_module(tmp_path: Path):
    module, optimizer = trained(seed=3)
    directory = save_stage_snapshot(tmp_path, "tail", module, optimizer, epoch=1, keep=1)

    other, other_opt = fresh(width=16)
    before = {key: value.clone() for key, value in other.state_dict().items()}
    with pytest.raises(SnapshotError, match="shape"):
        load_stage_snapshot(directory, other, other_opt)
    assert all(torch.equal(before[key], value) for key, value in other.state_dict().items())

    with pytest.raises(SnapshotError, match="stage tail, not head"):
        load_stage_snapshot(directory, *fresh(), stage="head")

    params = directory / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[-1] ^= 0xFF
    params.write_bytes(bytes(data))
    same, same_opt = fresh()
    with pytest.raises(SnapshotError, match="sha256"):
        load_stage_snapshot(directory, same, same_opt)


# -- serving --------------------------------------------------------------------------------------------


def test_file_server_honours_ranges(tmp_path: Path):
    payload = bytes(range(256)) * 40
    (tmp_path / "blob.bin").write_bytes(payload)
    with serve_directory(tmp_path) as server, httpx.Client() as client:
        assert server.url.startswith("http://127.0.0.1:")
        whole = client.get(f"{server.url}/blob.bin")
        assert whole.status_code == 200 and whole.content == payload
        assert whole.headers["Accept-Ranges"] == "bytes"
        part = client.get(f"{server.url}/blob.bin", headers={"Range": "bytes=100-199"})
        assert part.status_code == 206 and part.content == payload[100:200]
        assert part.headers["Content-Range"] == f"bytes 100-199/{len(payload)}"
        tail = client.get(f"{server.url}/blob.bin?X-Amz-Signature=abc", headers={"Range": "bytes=10000-"})
        assert tail.status_code == 206 and tail.content == payload[10000:]
        suffix = client.get(f"{server.url}/blob.bin", headers={"Range": "bytes=-5"})
        assert suffix.status_code == 206 and suffix.content == payload[-5:]
        beyond = client.get(f"{server.url}/blob.bin", headers={"Range": f"bytes={len(payload)}-"})
        assert beyond.status_code == 416 and beyond.headers["Content-Range"] == f"bytes */{len(payload)}"
        assert client.get(f"{server.url}/missing.bin").status_code == 404


# -- download -------------------------------------------------------------------------------------------


def published(tmp_path: Path, width: int = PUBLISHED_WIDTH) -> tuple[Path, Path, TinyStage, torch.optim.AdamW]:
    module, optimizer = trained(seed=4, width=width, steps=2)
    root = tmp_path / "store"
    directory = save_stage_snapshot(root, "body2", module, optimizer, epoch=12, keep=2)
    return root, directory, module, optimizer


def body_bytes(directory: Path, root: Path) -> int:
    documents = [root / "body2" / "latest.json", directory / "manifest.json"]
    files = [directory / "params.safetensors", directory / "optimizer.safetensors"]
    return sum(path.stat().st_size for path in documents + files)


def test_download_round_trip(tmp_path: Path):
    root, directory, module, optimizer = published(tmp_path)
    buffer = io.StringIO()
    with serve_directory(root) as server:
        target = download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(buffer))
        assert server.bytes_sent == body_bytes(directory, root)
    assert target == tmp_path / "dest" / "body2" / directory.name
    restored, restored_opt = fresh(width=PUBLISHED_WIDTH)
    assert load_stage_snapshot(target, restored, restored_opt).epoch == 12
    assert_same_state(module, optimizer, restored, restored_opt)
    events = events_of(buffer)
    assert [event.status for event in events if event.status != "progress"] == [
        "started",
        "verified",
        "started",
        "verified",
        "done",
    ]
    assert events[-1].bytes == events[-1].total == sum(path.stat().st_size for path in target.glob("*.safetensors"))
    assert not list(target.glob("*.part"))

    # A second call finds the files complete and verified: nothing is fetched again.
    with serve_directory(root) as server:
        download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "dest", events=EventWriter())
        assert server.bytes_sent == body_bytes(directory, root) - sum(
            p.stat().st_size for p in target.glob("*.safetensors")
        )


Send = Callable[[bytes], Awaitable[None]]


def test_every_file_comes_over_one_connection(tmp_path: Path):
    """Each file's body is read to its end, so the next file reuses the connection (no new TCP or TLS handshake)."""
    root, directory, _, _ = published(tmp_path)
    client_ports = []

    def record(response: httpx.Response) -> None:
        client_ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])

    with serve_directory(root) as server, httpx.Client(event_hooks={"response": [record]}) as client:
        download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(), client=client)
    assert len(client_ports) == 4  # latest.json, the manifest, two files
    assert len(set(client_ports)) == 1, client_ports


class CutOnce(StoreFront):
    """Drops the connection once, after CUT_AFTER bytes of the optimizer file's body."""

    CUT_AFTER = 300_000
    cut_done = threading.Event()
    ranges: list[str] = []

    async def on_request(self, target, headers):
        if "optimizer" in target:
            type(self).ranges.append(headers.get("Range", ""))

    async def relay_body(self, target: str, blocks: AsyncIterator[bytes], send: Send) -> None:
        if "optimizer" not in target or self.cut_done.is_set():
            return await super().relay_body(target, blocks, send)
        sent = 0
        async for block in blocks:
            room = self.CUT_AFTER - sent
            if room < len(block):
                await send(block[:room])
                self.cut_done.set()
                raise ConnectionAbortedError("test cut")
            await send(block)
            sent += len(block)


def test_cut_download_resumes_and_refetches_less_than_a_chunk(tmp_path: Path):
    root, directory, module, optimizer = published(tmp_path)
    assert (directory / "optimizer.safetensors").stat().st_size > CutOnce.CUT_AFTER + CHUNK
    buffer = io.StringIO()
    with serve_directory(root) as server, CutOnce(server.url) as front:
        target = download_snapshot(
            f"{front.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(buffer), backoff_s=0.05
        )
        sent = front.bytes_sent
    assert CutOnce.cut_done.is_set()
    refetched = sent - body_bytes(directory, root)
    assert 0 <= refetched < CHUNK
    assert CutOnce.ranges[0] == "" and CutOnce.ranges[1].startswith("bytes=")
    resumed_at = int(CutOnce.ranges[1].removeprefix("bytes=").rstrip("-"))
    assert CUT_BOUNDS[0] <= resumed_at <= CUT_BOUNDS[1]
    events = events_of(buffer)
    retries = [event for event in events if event.status == "retry"]
    assert len(retries) == 1 and "resuming at byte" in retries[0].message
    assert any(event.status == "started" and event.resumed_from == resumed_at for event in events)
    restored, restored_opt = fresh(width=PUBLISHED_WIDTH)
    load_stage_snapshot(target, restored, restored_opt)
    assert_same_state(module, optimizer, restored, restored_opt)


CUT_BOUNDS = (CutOnce.CUT_AFTER - CHUNK, CutOnce.CUT_AFTER)


def test_a_part_left_by_an_earlier_run_is_hashed_once_and_resumed(tmp_path: Path):
    root, directory, module, optimizer = published(tmp_path)
    source = directory / "optimizer.safetensors"
    kept = source.stat().st_size // 3
    part = tmp_path / "dest" / "body2" / directory.name / "optimizer.safetensors.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(source.read_bytes()[:kept])  # what a client killed mid-download leaves behind
    buffer = io.StringIO()
    with serve_directory(root) as server:
        target = download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(buffer))
        assert server.bytes_sent == body_bytes(directory, root) - kept
    assert any(event.status == "started" and event.resumed_from == kept for event in events_of(buffer))
    restored, restored_opt = fresh(width=PUBLISHED_WIDTH)
    load_stage_snapshot(target, restored, restored_opt)
    assert_same_state(module, optimizer, restored, restored_opt)


def test_a_damaged_part_left_by_an_earlier_run_fails_its_hash_and_is_fetched_again(tmp_path: Path):
    root, directory, module, optimizer = published(tmp_path)
    source = directory / "optimizer.safetensors"
    part = tmp_path / "dest" / "body2" / directory.name / "optimizer.safetensors.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\xff" * (source.stat().st_size // 2))
    buffer = io.StringIO()
    with serve_directory(root) as server:
        target = download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(buffer))
    retries = [event for event in events_of(buffer) if event.status == "retry"]
    assert len(retries) == 1 and "sha256 mismatch for optimizer.safetensors" in retries[0].message
    restored, restored_opt = fresh(width=PUBLISHED_WIDTH)
    load_stage_snapshot(target, restored, restored_opt)
    assert_same_state(module, optimizer, restored, restored_opt)


class CorruptOnce(StoreFront):
    """Flips one byte of the first params.safetensors body it sends."""

    corrupted = threading.Event()

    async def relay_body(self, target: str, blocks: AsyncIterator[bytes], send: Send) -> None:
        async for block in blocks:
            if "params" in target and not self.corrupted.is_set():
                self.corrupted.set()
                block = bytes([block[0] ^ 0xFF]) + block[1:]
            await send(block)


def test_corrupted_file_is_detected_and_fetched_again(tmp_path: Path):
    root, directory, module, optimizer = published(tmp_path)
    buffer = io.StringIO()
    with serve_directory(root) as server, CorruptOnce(server.url) as front:
        target = download_snapshot(f"{front.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(buffer))
        sent = front.bytes_sent
    assert CorruptOnce.corrupted.is_set()
    assert sent == body_bytes(directory, root) + (directory / "params.safetensors").stat().st_size
    retries = [event for event in events_of(buffer) if event.status == "retry"]
    assert len(retries) == 1 and "sha256 mismatch for params.safetensors" in retries[0].message
    restored, restored_opt = fresh(width=PUBLISHED_WIDTH)
    load_stage_snapshot(target, restored, restored_opt)
    assert_same_state(module, optimizer, restored, restored_opt)


def test_a_store_that_keeps_serving_a_damaged_file_fails_clearly(tmp_path: Path):
    root, directory, _, _ = published(tmp_path, width=32)
    params = directory / "params.safetensors"
    params.write_bytes(b"\0" * params.stat().st_size)  # same size, wrong content, manifest unchanged
    buffer = io.StringIO()
    with serve_directory(root) as server, pytest.raises(DownloadError, match="failed its sha256 check 3 times"):
        download_snapshot(f"{server.url}/body2/latest.json", tmp_path / "dest", events=EventWriter(buffer))
    assert events_of(buffer)[-1].status == "failed"


class RecordingFront(StoreFront):
    requested: list[str] = []

    async def on_request(self, target, headers):
        type(self).requested.append(target)


def test_presigned_style_urls_keep_their_own_query_strings(tmp_path: Path):
    root, directory, module, optimizer = published(tmp_path, width=32)
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    for name in ("params.safetensors", "optimizer.safetensors"):
        shutil.copy(directory / name, bucket / f"obj-{name}")
    RecordingFront.requested = []
    with serve_directory(tmp_path) as server, RecordingFront(server.url) as front:
        manifest = json.loads((directory / "manifest.json").read_text())
        for name in manifest["files"]:
            manifest["files"][name]["url"] = (
                f"{front.url}/bucket/obj-{name}?X-Amz-Signature=sig-{name[:3]}&X-Amz-Expires=600"
            )
        (bucket / "manifest.json").write_text(json.dumps(manifest))
        target = download_snapshot(
            f"{front.url}/bucket/manifest.json?X-Amz-Signature=sig-man", tmp_path / "dest", events=EventWriter()
        )
    assert "/bucket/obj-params.safetensors?X-Amz-Signature=sig-par&X-Amz-Expires=600" in RecordingFront.requested
    assert "/bucket/obj-optimizer.safetensors?X-Amz-Signature=sig-opt&X-Amz-Expires=600" in RecordingFront.requested
    local_manifest = (target / "manifest.json").read_text()
    assert "X-Amz-Signature" not in local_manifest  # presigned signatures are not written to disk
    restored, restored_opt = fresh()
    load_stage_snapshot(target, restored, restored_opt)
    assert_same_state(module, optimizer, restored, restored_opt)


def test_relative_file_urls_drop_the_manifest_query_string(tmp_path: Path):
    root, directory, _, _ = published(tmp_path, width=32)
    RecordingFront.requested = []
    with serve_directory(root) as server, RecordingFront(server.url) as front:
        download_snapshot(
            f"{front.url}/body2/{directory.name}/manifest.json?sig=only-for-the-manifest",
            tmp_path / "d",
            events=EventWriter(),
        )
    assert f"/body2/{directory.name}/params.safetensors" in RecordingFront.requested
    assert not any("sig=" in path for path in RecordingFront.requested[1:])


def test_unreachable_store_fails_with_a_clear_message(tmp_path: Path):
    with serve_directory(tmp_path) as server:
        url = f"{server.url}/head/latest.json"
    buffer = io.StringIO()
    with pytest.raises(DownloadError, match="could not reach .*head/latest.json"):
        download_snapshot(url, tmp_path / "dest", events=EventWriter(buffer), max_retries=1, backoff_s=0.01)
    assert events_of(buffer)[-1].status == "failed"
