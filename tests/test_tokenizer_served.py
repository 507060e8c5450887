"""The tokenizer belongs to the run: the auth service loads it at start and serves it, the run description pins its
sha256, and a joiner refuses a served file that differs or a vocabulary that is not the model's. Real HTTP servers
on 127.0.0.1 and a real ``agora auth`` process."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from agora_client import describe as describe_command
from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    run_description,
    write_demo_token_file,
)
from agora_client.auth.run_description import (
    RunDescriptionError,
    TokenizerSummary,
    describe_run,
    fetch_description,
    fetch_tokenizer,
    parse_description,
)
from agora_client.config import load_config
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.frontend.exit_codes import EXIT_ERROR
from tests.test_join_from_url import SEEDS, describe, service

REPO = Path(__file__).resolve().parent.parent
TEXT = "def tokenizer_round_trip(x):\n    return x + 1  # ünïcode too\n"


@contextmanager
def answering(routes: dict[str, bytes]) -> Iterator[str]:
    """A plain HTTP server that answers GET <path> with the given bytes (404 for others): an auth service that lies."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = routes.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def altered(content: bytes) -> bytes:
    """The same tokenizer with one merge's text changed: still valid JSON, another sha256."""
    data = json.loads(content)
    data["model"]["merges"][0] = data["model"]["merges"][-1]
    return json.dumps(data).encode()


def test_tokenizer_served_by_the_auth_service_encodes_like_the_run_config(tmp_path):
    expected = load_run_tokenizer(load_config("tiny2"))
    with service(tmp_path) as (server, _):
        run = fetch_description(server.url)
        served = httpx.get(f"{server.url}/v1/tokenizer")
        fetched = fetch_tokenizer(server.url, run)
    assert served.status_code == 200 and served.headers["content-type"] == "application/json"
    assert served.content == expected.content
    assert run.tokenizer == TokenizerSummary(expected.sha256, 2048, "<|endoftext|>")
    assert fetched.sha256 == expected.sha256 and fetched.vocab_size == 2048
    ids = expected.encode(TEXT)
    assert fetched.encode(TEXT) == ids and len(ids) < len(TEXT.encode())  # BPE, not bytes
    assert fetched.decode(ids) == TEXT


def test_tokenizer_section_is_covered_by_the_description_hash_and_checked():
    good = describe("tiny2").to_json()
    forged = json.loads(json.dumps(good))
    forged["tokenizer"]["sha256"] = "0" * 64
    with pytest.raises(RunDescriptionError, match="does not match its hash"):
        parse_description(forged, "test")
    missing = {key: value for key, value in good.items() if key != "tokenizer"}
    with pytest.raises(RunDescriptionError, match="names no usable tokenizer.*tell the swarm's operator"):
        parse_description(missing, "test")
    with pytest.raises(RunDescriptionError, match="names no usable tokenizer"):
        parse_description({**good, "tokenizer": {**good["tokenizer"], "vocab_size": "2048"}}, "test")
    with pytest.raises(RunDescriptionError, match="has 4,096 tokens but its model.vocab_size is 2,048"):
        parse_description({**good, "tokenizer": {**good["tokenizer"], "vocab_size": 4096}}, "test")
    assert parse_description(good, "test").tokenizer == describe("tiny2").tokenizer


def test_tokenizer_altered_on_the_way_is_refused(tmp_path):
    run = describe("tiny2")
    genuine = load_run_tokenizer(run.config).content
    routes = {"/v1/run": json.dumps(run.to_json()).encode(), "/v1/tokenizer": altered(genuine)}
    with answering(routes) as url:
        joined = fetch_description(url)
        with pytest.raises(
            RunDescriptionError,
            match=r"sha256 [0-9a-f]{16}\.\.\., but the run description says "
            rf"{run.tokenizer.sha256[:16]}",
        ):
            fetch_tokenizer(url, joined)
        routes["/v1/tokenizer"] = genuine[: len(genuine) // 2]  # cut short
        with pytest.raises(RunDescriptionError, match="altered or truncated"):
            fetch_tokenizer(url, joined)
        del routes["/v1/tokenizer"]  # an auth service older than the tokenizer endpoint
        with pytest.raises(
            RunDescriptionError, match="HTTP 404: the swarm's auth service does not serve the run's tokenizer"
        ):
            fetch_tokenizer(url, joined)


def test_tokenizer_larger_than_the_cap_is_not_read_to_the_end(monkeypatch):
    run = describe("tiny2")
    monkeypatch.setattr(run_description, "MAX_TOKENIZER_BYTES", 1 << 20)
    with answering({"/v1/tokenizer": b" " * (3 << 20)}) as url:
        with pytest.raises(RunDescriptionError, match="more than 1 MiB"):
            fetch_tokenizer(url, run)


def test_tokenizer_whose_vocab_is_not_the_models_is_refused_by_the_joiner(tmp_path):
    """A service that describes a 4,096-token model but serves (and pins) the 2,048-token file."""
    config = load_config("tiny2", {"model": {"vocab_size": 4096}})
    tokenizer = load_run_tokenizer(load_config("tiny2"))
    run = describe_run(config, SEEDS, None, None, TokenizerSummary(tokenizer.sha256, 4096, tokenizer.eos_token))
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=config.model.stage_names), seeds=SEEDS, run=run, tokenizer_json=tokenizer.content
    )
    write_demo_token_file(tmp_path / "tokens.json", "alice")
    with AuthServer(AuthService(settings, TokenFileIdentity(tmp_path / "tokens.json"), tmp_path / "state")) as server:
        with pytest.raises(RunDescriptionError, match="has 2,048 tokens but model.vocab_size is 4,096"):
            fetch_tokenizer(server.url, fetch_description(server.url))


def test_tokenizer_file_other_than_the_description_pins_is_not_served(tmp_path):
    run = describe("tiny2")
    content = load_run_tokenizer(run.config).content
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=run.config.model.stage_names), run=run, tokenizer_json=altered(content)
    )
    write_demo_token_file(tmp_path / "tokens.json", "alice")
    with pytest.raises(ValueError, match="describe the run with the tokenizer it serves"):
        AuthService(settings, TokenFileIdentity(tmp_path / "tokens.json"), tmp_path / "state")


def test_tokenizer_vocab_mismatch_stops_the_auth_service_at_start(tmp_path):
    preset = preset_file(tmp_path, {"model": {"vocab_size": 4096}})
    write_demo_token_file(tmp_path / "tokens.json", "alice")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "agora_cli.py"),
            "auth",
            "--config",
            preset,
            "--identity",
            "token-file",
            "--token-file",
            str(tmp_path / "tokens.json"),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[ERROR] cannot start the auth service: "), result.stderr
    assert "2,048 tokens" in lines[0] and "model.vocab_size is 4,096" in lines[0]
    assert "listening on" not in result.stdout


def test_tokenizer_altered_on_the_way_stops_a_joining_worker(tmp_path):
    """The headless client, against a service whose tokenizer file is not the one its description pins.

    It does not join."""
    with socket.socket() as seed:  # preflight dials the seeds: one that answers
        seed.bind(("127.0.0.1", 0))
        seed.listen()
        seeds = (f"/ip4/127.0.0.1/tcp/{seed.getsockname()[1]}/p2p/QmSeedA",)
        run = describe("tiny2", seeds)
        content = load_run_tokenizer(run.config).content
        routes = {"/v1/run": json.dumps(run.to_json()).encode(), "/v1/tokenizer": altered(content)}
        with answering(routes) as url:
            result = subprocess.run(
                [
                    sys.executable,
                    str(REPO / "agora_cli.py"),
                    "--headless",
                    "--allow-write-token",  # no Hugging Face here to ask what hf_test may do (test_token_scope.py)
                    "--cpu",
                    "--swarm",
                    url,
                    "--config-dir",
                    str(tmp_path / "client"),
                    "--host-port",
                    "0",
                ],
                env={**os.environ, "HF_TOKEN": "hf_test", "PYTHONPATH": str(REPO)},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=180,
            )
    assert result.returncode == EXIT_ERROR, (result.stdout, result.stderr)
    errors = [line for line in result.stdout.splitlines() if line.startswith("[ERROR]")]
    assert any(
        "the swarm's tokenizer cannot be used, so this worker does not join" in line and "altered or truncated" in line
        for line in errors
    ), result.stdout
    assert not any(line.startswith("[AUTH]") for line in result.stdout.splitlines())  # it never asked for a slot
    assert "Traceback" not in result.stderr


def test_tokenizer_is_shown_by_describe_and_a_wrong_vocab_fails_it(tmp_path, capsys):
    assert describe_command.run(argparse.Namespace(preset="tiny", json=False)) == 0
    expected = load_run_tokenizer(load_config("tiny"))
    assert (
        f"tokenizer demo-bpe-2k.json: sha256 {expected.sha256[:16]}, vocab 2,048, eos <|endoftext|>"
        in capsys.readouterr().out
    )
    assert (
        describe_command.run(
            argparse.Namespace(preset=preset_file(tmp_path, {"model": {"vocab_size": 4096}}), json=False)
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "has 2,048 tokens but model.vocab_size is 4,096" in err


def test_tokenizer_that_cannot_be_fetched_still_lets_describe_show_the_model(tmp_path, capsys):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/tokenizer.json"  # nothing listens: as a hub seen offline
    preset = preset_file(tmp_path, {"tokenizer": {"source": url, "sha256": None}})
    assert describe_command.run(argparse.Namespace(preset=preset, json=True)) == 0
    info = json.loads(capsys.readouterr().out)
    assert (
        info["stages"]
        and info["tokenizer"]["source"] == url
        and "could not download" in info["tokenizer"]["unavailable"]
    )
    assert describe_command.run(argparse.Namespace(preset=preset, json=False)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tokenizer ")]
    assert lines == [f"tokenizer {url}: not loaded ({info['tokenizer']['unavailable']})"]


def preset_file(tmp_path: Path, changes: dict) -> str:
    """tiny.yaml with some sections' fields changed, written to tmp_path."""
    preset = yaml.safe_load((REPO / "agora_client" / "presets" / "tiny.yaml").read_text())
    for section, fields in changes.items():
        preset[section].update(fields)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(preset))
    return str(path)
