"""One address holding 1,000 half-open connections (a request line, then a header line now and then, opened again
as soon as the service cuts it) against the auth service in a process whose open-file limit is 1,024, soft and hard
(so raising it at start cannot help), with no kernel firewall: the honest requests of another address are answered."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ATTACKER = "127.0.0.2"
HELD = 1_000
HONEST_REQUESTS = 400

SERVICE = """
import logging, resource, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[3])))
from agora_client.auth.admission import AdmissionPolicy
from agora_client.auth.identity import TokenFileIdentity
from agora_client.auth.server import AuthServer, AuthService, ServiceSettings
state = Path(sys.argv[1])
service = AuthService(
    ServiceSettings(policy=AdmissionPolicy(stages=("head",))), TokenFileIdentity(state / "tokens.json"), state / "auth"
)
with AuthServer(service) as server:
    print(server.url, flush=True)
    sys.stdin.read()
"""


def start_service(tmp_path: Path, soft: int, hard: int) -> tuple[subprocess.Popen, int]:
    (tmp_path / "tokens.json").write_text("{}")
    service = subprocess.Popen(
        [sys.executable, "-c", SERVICE, str(tmp_path), str(soft), str(hard)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = service.stdout.readline().strip()
    if not url:
        service.kill()
        pytest.fail(f"the auth service did not start: {service.communicate(timeout=30)[1][-2000:]}")
    return service, int(url.rsplit(":", 1)[1])


def stop_service(service: subprocess.Popen) -> str:
    """Its log, once it has stopped."""
    try:
        _, log = service.communicate("", timeout=30)
    except subprocess.TimeoutExpired:
        service.kill()
        _, log = service.communicate()
    return log


class HalfOpenAttacker:
    """Holds ``HELD`` connections from ``ATTACKER``, each a request head never finished; reopens what is cut."""

    def __init__(self, port: int):
        self.port, self.opened, self.holding = port, 0, threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._attack()), name="attacker", daemon=True)

    def __enter__(self) -> "HalfOpenAttacker":
        self._thread.start()
        assert self.holding.wait(60), "the attacker never opened its connections"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _open(self, writers: list, index: int) -> None:
        try:
            connecting = asyncio.open_connection("127.0.0.1", self.port, local_addr=(ATTACKER, 0))
            _, writer = await asyncio.wait_for(connecting, 5)
        except (OSError, asyncio.TimeoutError):
            return
        writer.write(b"GET /v1/status HTTP/1.1\r\nHost: agora\r\n")
        writers[index] = writer
        self.opened += 1

    async def _attack(self) -> None:
        writers: list = [None] * HELD
        while not self._stop.is_set():
            missing = [index for index, writer in enumerate(writers) if writer is None or writer.is_closing()]
            for start in range(0, len(missing), 500):  # in batches: the listen backlog is finite
                await asyncio.gather(*(self._open(writers, index) for index in missing[start : start + 500]))
            self.holding.set()
            await asyncio.sleep(0.5)
            for writer in writers:
                if writer is not None and not writer.is_closing():
                    writer.write(b"X-Trickle: 1\r\n")
        for writer in writers:
            if writer is not None:
                writer.transport.abort()


def honest_request(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"GET /v1/status HTTP/1.1\r\nHost: agora\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
    except OSError:
        return False
    return answer.startswith(b"HTTP/1.1 200")


def test_gaming_half_open_connections_from_one_address(tmp_path: Path):
    service, port = start_service(tmp_path, 1024, 1024)
    try:
        with HalfOpenAttacker(port) as attacker:
            answered = 0
            for _ in range(HONEST_REQUESTS):
                answered += honest_request(port)
                time.sleep(0.01)  # spread over many of the attacker's reconnections
            reopened = attacker.opened - HELD
    finally:
        log = stop_service(service)
    assert reopened > 0, "the service never cut an attacker's connection"
    assert answered >= 0.99 * HONEST_REQUESTS, f"{HONEST_REQUESTS - answered} honest requests failed"
    assert "Traceback" not in log


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] != resource.RLIM_INFINITY
    and resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 1024,
    reason="the hard open-file limit is 1,024: nothing to raise it to",
)
def test_a_service_raises_its_open_file_limit_and_says_so(tmp_path: Path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    service, _ = start_service(tmp_path, 1024, hard)
    log = stop_service(service)
    assert log.count("raised the open-file limit from 1024 to") == 1, log
