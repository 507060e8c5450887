"""A contributor's stage preparation: the snapshot download and the stage's build side by side, handed to the worker."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from hivemind.moe.server.module_backend import ModuleBackend

from agora_client.auth.client import StageAssignment
from agora_client.config import load_config
from agora_client.events import NULL_WRITER
from agora_client.joining.preparation import StagePreparation
from agora_client.model import build_stage
from agora_client.snapshots import (
    DownloadError,
    load_stage_snapshot,
    save_stage_snapshot,
    serve_directory,
)
from agora_client.worker.node import WorkerNode, WorkerOptions
from agora_client.worker.optimizer import build_optimizer
from agora_client.worker.prepared_stage import prepare_stage
from tests.store_front import StoreFront

CONFIG = load_config("tiny")
WAIT_S = 60.0  # bounds every wait of this module


class HeldUntilReleased(StoreFront):
    """A store whose every answer waits until the test releases it: a download that is still running."""

    release = threading.Event()

    async def on_request(self, target, headers):
        await asyncio.to_thread(type(self).release.wait, WAIT_S)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _alive(name: str) -> bool:
    return any(thread.name == name and thread.is_alive() for thread in threading.enumerate())


def test_the_stage_is_built_while_its_snapshot_still_downloads_and_both_are_handed_over(tmp_path: Path) -> None:
    published = build_stage(CONFIG.model, "body1", seed=7)
    optimizer = build_optimizer(list(published.parameters()), CONFIG)
    save_stage_snapshot(tmp_path / "store", "body1", published, optimizer, epoch=3, keep=1)
    HeldUntilReleased.release.clear()
    preparation = StagePreparation(CONFIG, "cpu", tmp_path / "downloads", NULL_WRITER)
    with serve_directory(tmp_path / "store") as store, HeldUntilReleased(store.url) as server:
        try:
            preparation.start(StageAssignment("body1", f"{server.url}/body1/latest.json"))
            assert _alive("stage build") and _alive("snapshot download")  # side by side, not one after the other
            _wait_until(lambda: not _alive("stage build"), "the stage is built")
            assert _alive("snapshot download")  # the build did not wait for the download
        finally:
            HeldUntilReleased.release.set()
        snapshot, prepared = preparation.result(threading.Event())
    assert prepared.stage == "body1" and not prepared.seeded  # the snapshot sets every weight
    load_stage_snapshot(
        snapshot, prepared.module, build_optimizer(list(prepared.module.parameters()), CONFIG), stage="body1"
    )
    for name, tensor in published.state_dict().items():
        assert torch.equal(prepared.module.state_dict()[name], tensor), name


def test_waiting_gives_up_when_stopped_and_a_failed_download_is_raised(tmp_path: Path) -> None:
    HeldUntilReleased.release.clear()
    stopped = StagePreparation(CONFIG, "cpu", tmp_path / "a", NULL_WRITER)
    with serve_directory(tmp_path) as store, HeldUntilReleased(store.url) as server:
        try:
            stopped.start(StageAssignment("head", f"{server.url}/head/latest.json"))
            stop = threading.Event()
            stop.set()
            assert stopped.result(stop) is None
        finally:
            HeldUntilReleased.release.set()
        failing = StagePreparation(CONFIG, "cpu", tmp_path / "b", NULL_WRITER)
        failing.start(StageAssignment("head", f"{server.url}/nothing/latest.json"))
        with pytest.raises(DownloadError, match="answered HTTP 404"):
            failing.result(threading.Event())


def test_the_same_stage_under_a_new_url_is_kept_and_another_stage_starts_again() -> None:
    preparation = StagePreparation(CONFIG, "cpu", Path("/nonexistent"), NULL_WRITER)
    with pytest.raises(RuntimeError, match="not assigned"):
        preparation.result(threading.Event())
    preparation.start(StageAssignment("head", None))
    preparation.start(StageAssignment("head", "http://127.0.0.1:1/presigned-again"))  # an object store's fresh URL
    assert preparation.assignment == StageAssignment("head", None)
    preparation.start(StageAssignment("tail", None))
    snapshot, prepared = preparation.result(threading.Event())
    assert snapshot is None and prepared.stage == "tail" and prepared.seeded  # no snapshot: weights from the seed


def test_a_prepared_stage_carries_the_schemas_hivemind_would_infer_and_fits_only_its_worker() -> None:
    prepared = prepare_stage(CONFIG, "tail", "cpu", seed=CONFIG.seed, seeded_weights=True)
    inferred = ModuleBackend("tail.0.0", prepared.module, args_schema=prepared.args_schema, max_batch_size=4)
    assert prepared.outputs_schema == inferred.outputs_schema
    with pytest.raises(ValueError, match="prepared stage is tail, not head"):
        WorkerNode(WorkerOptions(CONFIG, "head", [], prepared=prepared), NULL_WRITER)
    unseeded = prepare_stage(CONFIG, "tail", "cpu", seed=CONFIG.seed, seeded_weights=False)
    with pytest.raises(ValueError, match="without weights, and no snapshot"):
        WorkerNode(WorkerOptions(CONFIG, "tail", [], prepared=unseeded), NULL_WRITER)
