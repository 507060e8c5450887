"""An auth service in a process with a given open-file limit and no kernel firewall, and an attacker holding
``HELD`` half-open connections to it from one address (tests/test_gaming_half_open.py, bench/gaming.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

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
        raise RuntimeError(f"the auth service did not start: {service.communicate(timeout=30)[1][-2000:]}")
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
