"""The auth service's dial-back through a relay: the relay takes every connection to the port it holds for a
worker, so only the worker's libp2p host answering through it (it speaks first) makes the worker reachable."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from agora_client.auth.reachability import LIBP2P_HELLO, dial_back, parse_announce
from agora_client.relay import RelayReservation, RelayServer, RelaySettings


class _Greeter(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"\x13" + LIBP2P_HELLO)  # what a libp2p host says first on a new connection
        self.request.recv(64)


class _Silent(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.recv(64)  # takes the connection and says nothing until the dialer leaves


def _serve(handler: type[socketserver.BaseRequestHandler]) -> socketserver.ThreadingTCPServer:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def relay() -> Iterator[str]:
    server = RelayServer(RelaySettings(host="127.0.0.1", public_host="127.0.0.1", port_lo=47900, port_hi=47950)).start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def _dial_through(relay: str, worker_port: int) -> tuple[bool, str]:
    reservation = RelayReservation(relay, worker_port, on_lost=lambda reason: None)
    try:
        host, port = parse_announce(reservation.open())
        result = dial_back(host, port, timeout_s=2.0, through_relay=True)
    finally:
        reservation.close()
    return result.reachable, result.error


def test_relay_dial_back_passes_when_the_worker_answers_through_it(relay):
    server = _serve(_Greeter)
    try:
        assert _dial_through(relay, server.server_address[1]) == (True, "")
    finally:
        server.shutdown()


def test_relay_dial_back_fails_when_nothing_answers_behind_the_relay(relay):
    server = _serve(_Silent)
    try:
        assert _dial_through(relay, server.server_address[1]) == (False, "silent")
    finally:
        server.shutdown()
    with socket.socket() as probe:  # a worker whose port is closed: the relay splices to nothing
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    assert _dial_through(relay, closed_port) == (False, "silent")
