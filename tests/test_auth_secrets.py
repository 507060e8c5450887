"""The contributor token reaches no log line, event, exception, output or file of the client or the service."""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth import (
    AdmissionPolicy,
    AuthError,
    AuthServer,
    AuthService,
    HuggingFaceIdentity,
    Secret,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    leave,
    write_demo_token_file,
)
from agora_client.auth.key_proof import peer_id_of_public_key
from agora_client.events import EventWriter
from agora_client.snapshots import download_snapshot, save_stage_snapshot, serve_directory
from tests.test_auth import WhoamiHandler

REPO = Path(__file__).resolve().parents[1]
HF_TOKEN = "hf_goodtoken123"
WRONG_TOKEN = "hf_wrongtoken_Zq9xv"


def leaks(secrets: list[str], *texts: str) -> list[str]:
    """Which secrets (by position, so a failing test does not print them) occur in the texts."""
    return [f"secret #{index}" for index, secret in enumerate(secrets) for text in texts if secret in text]


def files_containing(secrets: list[str], *roots: Path) -> list[str]:
    found = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                found += [f"{path}: secret #{index}" for index, secret in enumerate(secrets) if secret.encode() in data]
    return found


def test_secret_is_redacted_everywhere():
    secret = Secret("hf_abcdef")
    for shown in (repr(secret), str(secret), f"{secret}", f"{secret!r}", f"{[secret]}", str(ValueError(secret))):
        assert "hf_abcdef" not in shown and "REDACTED" in shown
    assert secret.reveal() == "hf_abcdef" and secret == Secret("hf_abcdef")
    with pytest.raises(TypeError):
        pickle.dumps(secret)


def test_token_never_leaks_from_service_or_client(tmp_path: Path, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # every logger, including httpx / httpcore / huggingface_hub
    token_file = tmp_path / "service" / "tokens.json"
    demo_token = write_demo_token_file(token_file, "demo")
    secrets = [demo_token, HF_TOKEN, WRONG_TOKEN]
    state_dir, dest_dir = tmp_path / "service" / "state", tmp_path / "client"
    buffer = io.StringIO()
    events = EventWriter(buffer)
    errors: list[str] = []

    # A snapshot store, so the client also downloads and writes files.
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    save_stage_snapshot(tmp_path / "store", "head", module, optimizer, epoch=1, keep=1)

    hub = ThreadingHTTPServer(("127.0.0.1", 0), WhoamiHandler)
    threading.Thread(target=hub.serve_forever, args=(0.05,), daemon=True).start()
    try:
        with serve_directory(tmp_path / "store") as store:
            policy = AdmissionPolicy(
                stages=("head",), max_workers_per_stage=2, per_identity_cap=1, pacing_s=5.0
            )  # long enough to queue under load
            settings = ServiceSettings(policy=policy, snapshot_url=store.url, poll_every_s=0.05)
            for source in (
                TokenFileIdentity(token_file),
                HuggingFaceIdentity(f"http://127.0.0.1:{hub.server_address[1]}"),
            ):
                good = demo_token if isinstance(source, TokenFileIdentity) else HF_TOKEN
                with AuthServer(AuthService(settings, source, state_dir)) as server:
                    granted = authorize(server.url, good, f"p1-{id(source)}", events=events, poll_every=0.05)
                    download_snapshot(granted.snapshot_url, dest_dir, events=events)
                    for token, peer in ((good, f"p2-{id(source)}"), (WRONG_TOKEN, "p3"), ("", "p4")):
                        try:
                            authorize(server.url, token, peer, events=events, poll_every=0.05)
                        except AuthError as error:
                            errors += [str(error), repr(error), repr(error.__context__), str(error.__cause__)]
                    # A queued client: once the first peer left, pacing holds the next join for a while.
                    leave(server.url, granted.ticket)
                    queued = authorize(server.url, good, f"p6-{id(source)}", events=events, poll_every=0.05)
                    errors.append(repr(queued))
                    leave(
                        server.url, queued.ticket
                    )  # the next service reads this state dir: it starts with a free stage
                # The service is gone: the connection error must not quote the request either.
                try:
                    authorize(server.url, good, "p5", events=events)
                except AuthError as error:
                    errors += [str(error), repr(error)]
    finally:
        hub.shutdown()
        hub.server_close()

    captured = capsys.readouterr()
    # The flows really ran: admitted, queued, rejected by the cap, refused as invalid.
    for seen in ('"status":"authorized"', '"kind":"queue"', "already runs 1 peers", "did not accept", "verified"):
        assert seen in buffer.getvalue(), seen
    assert any("admitted peer" in record.getMessage() for record in caplog.records)
    assert any(record.name.startswith("httpx") for record in caplog.records)  # DEBUG capture really worked
    assert (state_dir / "joins.jsonl").read_text().count("invalid_token") == 2
    assert not leaks(secrets, caplog.text, buffer.getvalue(), captured.out, captured.err, *errors)
    assert not files_containing(secrets, tmp_path / "service", dest_dir)


def test_auth_command_runs_and_keeps_the_token_out_of_its_output(tmp_path: Path):
    token_file = tmp_path / "tokens.yaml"
    token = write_demo_token_file(token_file, "demo")
    command = [
        sys.executable,
        str(REPO / "agora_cli.py"),
        "auth",
        "--identity",
        "token-file",
        "--token-file",
        str(token_file),
        "--state-dir",
        str(tmp_path / "state"),
        "--log-level",
        "DEBUG",
        "--pacing",
        "0",
        "--config",
        "tiny",
        "--no-dial-back",
        "--snapshot-url",
        "http://127.0.0.1:9/snapshots",
        "--seed",
        "/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",
    ]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        ready = process.stdout.readline()
        assert ready.startswith("[AUTH] listening on "), ready + process.stderr.read()
        url = ready.removeprefix("[AUTH] listening on ").strip()
        key = RSAPrivateKey()  # the CLI's service admits only joins signed with the key of their peer id
        granted = authorize(
            url, token, peer_id_of_public_key(key.get_public_key().to_bytes()), events=EventWriter(), peer_key=key
        )
        assert granted.stage == "head" and granted.snapshot_url == "http://127.0.0.1:9/snapshots/head/latest.json"
        assert granted.seeds == ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",)
        rejected = httpx.post(f"{url}/v1/join", json={"token": token + "x", "peer_id": "peerBad"})
        assert rejected.status_code == 401
        assert httpx.get(f"{url}/v1/status").json()["stages"]["head"]["pending"] == 1
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=15)
        assert process.returncode == 0, err
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    output = ready + out + err
    assert "/v1/join" in err  # the request log really was captured at DEBUG
    assert "Traceback" not in output
    assert token not in output and token + "x" not in output
    assert not files_containing([token], tmp_path / "state")


def test_auth_command_bad_configuration_is_one_clear_line(tmp_path: Path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "agora_cli.py"),
            "auth",
            "--identity",
            "token-file",
            "--token-file",
            str(tmp_path / "missing.yaml"),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot start the auth service" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
