"""Snapshots and checkpoints in an S3-compatible bucket: a real S3-protocol server (moto's server mode,
its own process on 127.0.0.1), boto3 on our side, presigned links for joiners, the unchanged download."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto")

from agora_client.auth.admission import AdmissionPolicy  # noqa: E402
from agora_client.auth.client import authorize  # noqa: E402
from agora_client.auth.identity import TokenFileIdentity, write_demo_token_file  # noqa: E402
from agora_client.auth.main import _object_store_links  # noqa: E402
from agora_client.auth.server import AuthServer, AuthService, ServiceSettings  # noqa: E402
from agora_client.checkpoints import select_set  # noqa: E402
from agora_client.checkpoints.export import load_set  # noqa: E402
from agora_client.events import EventWriter, parse_event  # noqa: E402
from agora_client.snapshots import (  # noqa: E402
    SnapshotError,
    download_snapshot,
    keep_newest,
    load_stage_snapshot,
    open_store,
)
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402
from tests.test_checkpoints import CONFIG, T0, perturbed_stage, save  # noqa: E402

BUCKET = "agora-test"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server as a process on loopback, with the AWS_* variables boto3 reads pointing at it."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    patch = pytest.MonkeyPatch()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            patch.setenv(name, value)
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        patch.undo()
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def store(s3_endpoint, request):
    return open_store(f"s3://{BUCKET}/{request.node.name}")


def test_save_list_prune_and_load_round_trip(store, tmp_path):
    written = [save(store, "body1", T0 + 60 * i, epoch=i, seed=i) for i in range(3)]
    assert store.stages() == ["body1"] and store.list("body1") == written
    store.prune("body1", keep_newest(2))
    assert store.list("body1") == written[1:]
    local = store.local_dir(written[-1], tmp_path)
    module, optimizer = perturbed_stage("body1", 99)
    info = load_stage_snapshot(local, module, optimizer, stage="body1")
    expected, _ = perturbed_stage("body1", 2)
    assert info.epoch == 2
    for (name, value), reference in zip(module.state_dict().items(), expected.state_dict().values(), strict=True):
        assert torch.equal(value, reference), name


def test_auth_hands_joiners_presigned_links_and_the_download_resumes_against_them(store, tmp_path):
    snapshot = save(store, "head", T0, epoch=4)
    token_file = tmp_path / "tokens.json"
    token = write_demo_token_file(token_file, "alice")
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=("head",), pacing_s=0.0), snapshot_links=_object_store_links(store.location)
    )
    with AuthServer(AuthService(settings, TokenFileIdentity(token_file), tmp_path / "auth")) as server:
        url = authorize(server.url, token, "peer-a", events=EventWriter(), poll_every=0.05).snapshot_url
    assert url is not None and "X-Amz-Signature=" in url
    manifest = httpx.get(url).json()
    assert all("X-Amz-Signature=" in entry["url"] for entry in manifest["files"].values())
    # a transfer cut halfway: the client resumes it with a Range request against the presigned URL
    target = tmp_path / "head" / snapshot.name
    target.mkdir(parents=True)
    params = httpx.get(manifest["files"]["params.safetensors"]["url"]).content
    (target / "params.safetensors.part").write_bytes(params[: len(params) // 2])
    lines: list[str] = []
    events = EventWriter()
    events.add_sink(type("Sink", (), {"write": lambda self, line: lines.append(line), "flush": lambda self: None})())
    directory = download_snapshot(url, tmp_path, events=events, progress_every_s=0)
    seen = [parse_event(line) for line in lines]
    started = [event for event in seen if event.status == "started" and event.file == "params.safetensors"]
    assert started[0].resumed_from == len(params) // 2
    assert any(event.status == "progress" for event in seen) and seen[-1].status == "done"
    module, optimizer = perturbed_stage("head", 99)
    assert load_stage_snapshot(directory, module, optimizer, stage="head").epoch == 4
    assert "X-Amz" not in (directory / "manifest.json").read_text()  # signatures stay off disk


def test_links_are_reused_then_renewed_for_a_newer_snapshot(store):
    save(store, "tail", T0, epoch=1)
    first = store.joiner_url("tail")
    assert store.joiner_url("tail") == first
    save(store, "tail", T0 + 60, epoch=2)
    assert store.joiner_url("tail") != first
    assert store.joiner_url("body9") is None  # no snapshot of that stage yet


def test_export_and_resume_read_a_set_from_the_bucket(store, tmp_path):
    for index, stage in enumerate(CONFIG.model.stage_names):
        save(store, stage, T0 + index, epoch=7, seed=index)
    chosen = select_set(store)
    _, stages = load_set(store, chosen, tmp_path / "cache")
    assert set(stages) == set(CONFIG.model.stage_names)
    swarm = LocalSwarm(SwarmOptions(run_dir=tmp_path / "run", resume=True, resume_from=store.location))
    swarm.prepare_resume()  # fetches and verifies every stage's files; no process is started
    assert {stage: path.name for stage, path in swarm.resume_dirs.items()} == {
        s: m.name for s, m in chosen.members.items()
    }


def test_an_unreachable_bucket_is_one_clear_error(s3_endpoint):
    store = open_store("s3://no-such-bucket/x")
    with pytest.raises(
        SnapshotError, match="S3 store s3://no-such-bucket/x: .*NoSuchBucket.*check the bucket name"
    ) as caught:
        store.list("head")
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in str(caught.value)
    with pytest.raises(SnapshotError, match="names no bucket"):
        open_store("s3:///prefix")
