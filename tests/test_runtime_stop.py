"""Quitting during the snapshot download: the real runtime stops within 5 s, frees its slot and leaves no process.

A real auth service (token file identities) hands out a slot whose snapshot comes from a real HTTP
server that trickles bytes, so the download is still running when the user presses Ctrl-C.
An in-process DHT peer stands in for the seeds: the runtime opens its port on the DHT before it joins.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import hivemind
import psutil
import pytest
import torch

from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    swarm_status,
    write_demo_token_file,
)
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.config import load_config
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.model import build_stage
from agora_client.snapshots import save_stage_snapshot
from agora_client.snapshots.server import serve_directory
from tests.store_front import StoreFront

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)  # process start-up is slow on a loaded machine; the 5 s bound is on the stop


class Trickle(StoreFront):
    """Sends a few KB per second: a download that takes minutes."""

    async def relay_body(self, target, blocks, send) -> None:
        async for block in blocks:
            for start in range(0, len(block), 4096):
                await send(block[start : start + 4096])
                await asyncio.sleep(0.5)


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def test_ctrl_c_during_the_download_stops_within_5s_and_frees_the_slot(tmp_path):
    config = load_config("tiny")
    tokenizer = load_run_tokenizer(config)  # the client checks the served tokenizer before it joins
    module = build_stage(config.model, "head", seed=0)
    save_stage_snapshot(tmp_path / "snaps", "head", module, torch.optim.AdamW(module.parameters()), epoch=3, keep=1)
    token_file = tmp_path / "tokens.json"
    token = write_demo_token_file(token_file, "alice")
    seed = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    seeds = tuple(str(maddr) for maddr in seed.get_visible_maddrs())
    try:
        with serve_directory(tmp_path / "snaps") as store, Trickle(store.url) as snapshots:
            settings = ServiceSettings(
                policy=AdmissionPolicy(stages=tuple(config.model.stage_names), pacing_s=0.0),
                snapshot_url=snapshots.url,
                seeds=seeds,
                tokenizer_json=tokenizer.content,
                run=describe_run(config, seeds, snapshots.url, None, TokenizerSummary.of(tokenizer)),
            )
            with AuthServer(AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")) as auth:
                client = subprocess.Popen(
                    [
                        sys.executable,
                        str(ROOT / "agora_cli.py"),
                        "--headless",
                        "--cpu",
                        "--swarm",
                        auth.url,
                        "--config-dir",
                        str(tmp_path / "client"),
                        "--host-port",
                        "0",
                    ],
                    env={**os.environ, "HF_TOKEN": token, "PYTHONPATH": str(ROOT)},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                try:
                    lines = []
                    deadline = time.monotonic() + 180
                    while not any(line.startswith("[DOWNLOAD]") and "%" in line for line in lines):
                        assert time.monotonic() < deadline and client.poll() is None, lines
                        lines.append(client.stdout.readline().rstrip("\n"))
                    assert swarm_status(auth.url)["occupied"] == 1
                    runtime = psutil.Process(client.pid).children()[0]
                    pgid = os.getpgid(runtime.pid)  # the runtime leads its own process group
                    started = time.monotonic()
                    client.send_signal(signal.SIGINT)
                    out, err = client.communicate(timeout=30)
                    took = time.monotonic() - started
                finally:
                    if client.poll() is None:
                        client.kill()
                assert took < 5, f"stopping took {took:.1f}s"
                assert client.returncode == 130, err
                assert _group_alive(pgid) == []
                assert swarm_status(auth.url)["occupied"] == 0  # the slot was given back
                assert "Interrupted: stopping the worker" in out
                assert "Traceback" not in err and "Traceback" not in out
    finally:
        seed.shutdown()
