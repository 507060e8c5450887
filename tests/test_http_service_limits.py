"""The services' HTTP front holds up against slow and greedy clients: a real auth service on 127.0.0.1, real sockets.

Clients that misbehave connect from 127.0.0.2 and up (still this host's loopback), honest ones from 127.0.0.1.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    write_demo_token_file,
)
from agora_client.http_service import RateLimit, ServiceLimits

pytestmark = pytest.mark.timeout(60)


@contextmanager
def auth_server(tmp_path: Path, **server_options):
    token_file = tmp_path / "tokens.json"
    write_demo_token_file(token_file, "alice")
    settings = ServiceSettings(policy=AdmissionPolicy(stages=("head", "body1", "tail"), pacing_s=0.0))
    service = AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")
    with AuthServer(service, **server_options) as server:
        yield server


def connect(server: AuthServer, source: str) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    return client


def closed_by_server(client: socket.socket, wait_s: float) -> bool:
    """True once the server closed (or reset) the connection within ``wait_s``; False if it stays open."""
    client.settimeout(wait_s)
    try:
        return client.recv(1024) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def status_ok(server: AuthServer) -> bool:
    return httpx.get(f"{server.url}/v1/status", timeout=5).status_code == 200


def test_a_request_head_sent_line_by_line_is_cut_after_the_header_timeout(tmp_path: Path):
    with auth_server(tmp_path, limits=ServiceLimits(header_timeout_s=1.0, keepalive_timeout_s=30)) as server:
        slow = connect(server, "127.0.0.2")
        started = time.monotonic()
        slow.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        cut = False
        while not cut and time.monotonic() - started < 5:
            with suppress(OSError):
                slow.sendall(b"X-Trickle: 1\r\n")  # a line every 0.2 s: no single line is slow, the head is
            cut = closed_by_server(slow, 0.2)
        elapsed = time.monotonic() - started
        assert cut and 0.9 <= elapsed <= 3.0, elapsed
        # A whole head sent at once on a fresh connection is answered, and so is the next one on it (keep-alive).
        fast = connect(server, "127.0.0.2")
        for _ in range(2):
            fast.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
            assert fast.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(1.2)  # longer than the header timeout: an idle keep-alive connection is not a slow head
        fast.close()


def test_connections_over_the_per_address_cap_are_closed_at_once_while_other_addresses_are_served(tmp_path: Path):
    with auth_server(tmp_path, limits=ServiceLimits(max_connections_per_address=5)) as server:
        held = [connect(server, "127.0.0.2") for _ in range(5)]
        time.sleep(0.2)
        extra = connect(server, "127.0.0.2")
        assert closed_by_server(extra, 2.0)
        assert not any(closed_by_server(client, 0.05) for client in held)
        assert status_ok(server)  # 127.0.0.1 is another address
        held[0].sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")  # the held ones are served too
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
        for client in held:
            client.close()
        time.sleep(0.2)
        again = connect(server, "127.0.0.2")  # closed connections give their place back
        assert not closed_by_server(again, 0.3)
        again.close()


def test_joins_over_the_rate_limit_get_429_with_retry_after(tmp_path: Path):
    limit = RateLimit(per_minute=6, burst=2, exempt_loopback=False)
    with auth_server(tmp_path, join_rate=limit) as server:
        url = f"{server.url}/v1/join"
        answers = [httpx.post(url, json={"token": "wrong", "peer_id": "peerA"}, timeout=5) for _ in range(3)]
        assert [answer.status_code for answer in answers] == [401, 401, 429]
        refused = answers[-1]
        assert refused.json()["status"] == "error" and "too many requests" in refused.json()["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 10
        assert status_ok(server)  # only the chosen routes are limited
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
            assert other.post(url, json={"token": "wrong", "peer_id": "peerB"}, timeout=5).status_code == 401


def test_loopback_clients_are_not_rate_limited_by_default(tmp_path: Path):
    with auth_server(tmp_path, join_rate=RateLimit(per_minute=6, burst=2)) as server:
        answers = [
            httpx.post(f"{server.url}/v1/join", json={"token": "wrong", "peer_id": "p"}, timeout=5) for _ in range(4)
        ]
        assert {answer.status_code for answer in answers} == {401}


def test_an_oversized_body_gets_413_and_a_slow_body_408(tmp_path: Path):
    with auth_server(tmp_path, limits=ServiceLimits(body_timeout_s=1.0)) as server:
        big = httpx.post(f"{server.url}/v1/join", content=b"{" + b" " * (70 * 1024) + b"}", timeout=5)
        assert big.status_code == 413 and big.json()["status"] == "error"
        slow = connect(server, "127.0.0.2")
        started = time.monotonic()
        slow.sendall(b'POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"token": ')
        answer = slow.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and 0.9 <= time.monotonic() - started <= 3.0
        assert closed_by_server(slow, 2.0)


def test_honest_requests_succeed_while_300_half_open_connections_are_held(tmp_path: Path):
    with auth_server(tmp_path) as server:
        # 30 from each of 10 addresses: under the per-address cap, so the service really holds all 300
        half_open = [connect(server, f"127.0.0.{2 + index % 10}") for index in range(300)]
        for client in half_open:
            client.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        answers = [status_ok(server) for _ in range(20)]
        assert all(answers) and time.monotonic() - started < 10
        assert not any(closed_by_server(client, 0.001) for client in half_open)  # still held, not dropped
        for client in half_open:
            client.close()
