"""`agora monitor` start-up: bad input gets one clear error; the auth key can come from the auth service."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agora_client.auth.tickets import generate_signing_key, public_key_text
from agora_client.monitor import main as monitor_main

REPO = Path(__file__).resolve().parents[1]
SEED = "/ip4/127.0.0.1/tcp/9/p2p/QmYUgdgkmr98ZE6P6xGHgnVEpmH596jSUnWCeQB4Ha2SwW"


def run_monitor(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "agora_cli.py"), "monitor", "--db", str(tmp_path / "p.sqlite"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_bad_input_ends_the_process_with_one_clear_error(tmp_path):
    result = run_monitor("--auth-public-key", "x", tmp_path=tmp_path)
    assert result.returncode == 2
    assert "--initial-peers" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--initial-peers", SEED), "--auth-public-key KEY or --auth-url"),
        (("--initial-peers", SEED, "--auth-public-key", "not a key!"), "not base64"),
        (("--initial-peers", SEED, "--auth-public-key", "AAAA"), "decodes to 3 bytes"),
        (("--initial-peers", SEED, "--auth-url", "http://127.0.0.1:9"), "is the auth service running"),
        (("--initial-peers", SEED, "--auth-public-key", "x", "--stages", "head,middle"), "unknown stage(s) middle"),
    ],
)
def test_each_bad_input_gets_its_own_clear_error(args, message, tmp_path, monkeypatch, capsys):
    # in this process (one start-up costs seconds): the command's own run(), without its signal handlers
    monkeypatch.setattr(monitor_main, "stop_on_signals", threading.Event)
    parser = argparse.ArgumentParser()
    monitor_main.configure(parser)
    assert monitor_main.run(parser.parse_args(["--db", str(tmp_path / "p.sqlite"), *args])) == 2
    assert message in capsys.readouterr().err


class _Status(BaseHTTPRequestHandler):
    body = b"{}"

    def do_GET(self):
        self.send_response(200 if self.path == "/v1/status" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_public_key_is_read_from_the_auth_status_endpoint():
    key = public_key_text(generate_signing_key())
    handler = type("Handler", (_Status,), {"body": json.dumps({"status": "ok", "public_key": key}).encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert monitor_main.auth_public_key(argparse.Namespace(auth_public_key=None, auth_url=url)) == key
    finally:
        server.shutdown()
        server.server_close()
