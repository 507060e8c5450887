"""Support bundle: contents, and no trace of a planted token anywhere in the zip."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from agora_client.client_config import ClientConfig, ClientConfigStore
from agora_client.events import AuthEvent, LogEvent, ReachabilityEvent
from agora_client.logs import EventLog
from agora_client.network import NetworkFacts, diagnose
from agora_client.system.bundle import build_bundle, system_report
from agora_client.system.redact import REDACTED, redact_data, redact_line, redact_text

TOKEN = "hf_PlantedToken0123456789abcdef"
PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
PEM = (
    "-----BEGIN PRIVATE KEY-----\n"
    "MC4CAQAwBQYDK2VwBCIEIJ+DYvh6SEqVTm50DFtMDoQikTmiCqirVv9mWG9qfSnF\n"
    "-----END PRIVATE KEY-----"
)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    config_dir = tmp_path / "config"
    store = ClientConfigStore(config_dir)
    store.save(ClientConfig(swarm_url="http://127.0.0.1:8470", gpu_index=0))
    store.save_token(TOKEN)
    # A log written without the known secret list, so only the pattern and key rules protect it.
    log = EventLog(config_dir / "logs", "gpu0")
    log.write_event(AuthEvent(status="authorized", identity="alice", peer_id=PEER, message=f"token {TOKEN[:-1]}X ok"))
    log.close()
    # Raw lines that bypassed EventLog (an older client, a hand-copied file).
    with open(config_dir / "logs" / "gpu1.jsonl", "w") as raw:
        raw.write(json.dumps({"kind": "log", "hf_token": TOKEN, "message": f"env HF_TOKEN={TOKEN}"}) + "\n")
        raw.write(f"Authorization: Bearer {TOKEN}\n")
        raw.write(json.dumps({"kind": "log", "message": PEM}) + "\n")
    return config_dir


def test_bundle_holds_logs_config_and_report_without_the_token(planted, tmp_path):
    report = system_report(planted)
    report["env_dump"] = f"HF_TOKEN={TOKEN}\nAGORA_API_KEY=sk-{TOKEN}"
    extra = [f"12:00 [AUTH] using {TOKEN}", LogEvent(message=f"Bearer {TOKEN}").model_dump_json()]
    path = build_bundle(
        tmp_path / "out", config_dir=planted, logs_dir=planted / "logs", extra_lines=extra, report=report
    )
    with zipfile.ZipFile(path) as bundle:
        names = set(bundle.namelist())
        assert {"README.txt", "system.json", "config.json", "logs/gpu0.jsonl", "logs/gpu1.jsonl", "recent.txt"} <= names
        blob = b"".join(bundle.read(name) for name in names)
        config = json.loads(bundle.read("config.json"))
        system = json.loads(bundle.read("system.json"))
    for secret in (TOKEN, TOKEN[3:], TOKEN[:-1], "MC4CAQAwBQYDK2VwBCIEIJ"):
        assert secret.encode() not in blob
    assert config["hf_token"] == REDACTED and config["swarm_url"] == "http://127.0.0.1:8470"
    assert {"os", "python", "torch", "nvidia", "ram", "disk", "packages"} <= set(system)
    assert system["packages"]["textual"] != "not installed"
    assert PEER.encode() in blob  # public peer ids stay, so support can find the peer


def test_export_logs_command_prints_the_path_and_asks_for_review(planted, tmp_path, capsys):
    from agora_client.cli import main

    code = main(["export-logs", "--config-dir", str(planted), "--output", str(tmp_path / "cli-out")])
    out = capsys.readouterr().out
    assert code == 0
    path = out.splitlines()[0].removeprefix("Support bundle written to ")
    assert zipfile.is_zipfile(path) and "Review the bundle before sharing it" in out


def test_redaction_rules():
    assert redact_text(f"x HF_TOKEN={TOKEN} y") == f"x HF_TOKEN={REDACTED} y"
    assert TOKEN not in redact_text(f"Authorization: Bearer {TOKEN}")
    assert redact_text("Authorization: Basic dXNlcjpwYXNzd29yZA==") == f"Authorization: {REDACTED}"
    assert (
        redact_text("AGORA_API_KEY=sk-abc123 db_password: hunter2")
        == f"AGORA_API_KEY={REDACTED} db_password: {REDACTED}"
    )
    assert redact_text('{"ticket": "eyJhbGciOi.x.y"}') == f'{{"ticket": "{REDACTED}"}}'
    assert redact_text(f"{PEM}\nafter") == f"{REDACTED}\nafter"
    assert redact_text("loss 3.2141 at epoch 12, 24.0 MB/s") == "loss 3.2141 at epoch 12, 24.0 MB/s"
    assert json.loads(redact_line(json.dumps({"private_key": "abc", "stage": "body1"}))) == {
        "private_key": REDACTED,
        "stage": "body1",
    }
    assert redact_text("plain secret value", ["secret value"]) == f"plain {REDACTED}"


@pytest.mark.parametrize(
    "harmless",
    [
        # what redacting long runs of characters used to damage (issue #16)
        "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/hivemind/averaging/averager.py line 412",
        'File "/work/runs/demo/20261123-161000/client/snapshots/body1/20261123T160955Z/params.safetensors"',
        "snapshot 2026-11-23T16:09:55.344241Z ready in 2026-11-23T16:10:02.344241Z",
        "hf_token_from_env=False",
        "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 verified",
        "peer 12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo joined",
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGq2ZxY host",  # a public key
        "max_tokens=512 num_tokens: 12 monkey=banana hf_transfer enabled",
    ],
)
def test_harmless_text_is_kept(harmless):
    assert redact_text(harmless) == harmless


def test_a_flag_about_a_token_is_not_a_token():
    assert redact_data({"hf_token_from_env": False, "tokens": 3, "hf_token": "hf_x"}) == {
        "hf_token_from_env": False,
        "tokens": 3,
        "hf_token": REDACTED,
    }


def test_export_logs_finds_the_most_recent_run(tmp_path, monkeypatch, capsys):
    from agora_client.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    saved = tmp_path / "xdg" / "agora"
    with EventLog(saved / "logs", "cpu") as log:
        log.write_event(LogEvent(message="an older run"))
    demo = Path("runs") / "demo" / "20260101-000000" / "client"
    with EventLog(demo / "logs", "cpu") as log:
        log.write_event(LogEvent(message="the demo just now"))
    os.utime(saved / "logs" / "cpu.jsonl", (1, 1))  # older than the demo's
    assert main(["export-logs", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "most recent run, in runs/demo/20260101-000000/client/logs" in out
    path = next(line for line in out.splitlines() if line.startswith("Support bundle written to ")).removeprefix(
        "Support bundle written to "
    )
    with zipfile.ZipFile(path) as bundle:
        assert b"the demo just now" in bundle.read("logs/cpu.jsonl")


def test_bundle_holds_the_newest_network_diagnosis(planted, tmp_path):
    network = diagnose(
        NetworkFacts("192.168.1.20", 49200, "refused", "Action not authorized", "81.2.69.142", "81.2.69.142")
    )
    older = diagnose(NetworkFacts("192.168.1.20", 49200, "not offered", seen_address="81.2.69.142"))
    log = EventLog(planted / "logs", "gpu0")
    log.write_event(ReachabilityEvent(status="unreachable", address="81.2.69.142:49200", network=older))
    log.write_event(
        ReachabilityEvent(
            status="reachable", address="11.77.0.2:47000", path="relayed", relay="11.77.0.2:42581", network=network
        )
    )
    log.close()
    path = build_bundle(tmp_path / "out", config_dir=planted, logs_dir=planted / "logs", report={"os": "test"})
    with zipfile.ZipFile(path) as bundle:
        shown = json.loads(bundle.read("network.json"))
    assert (shown["status"], shown["path"], shown["relay"]) == ("reachable", "relayed", "11.77.0.2:42581")
    assert shown["mapping"] == "refused"
    assert shown["local_address"] == "192.168.1.20" and shown["mapping_detail"] == "Action not authorized"
