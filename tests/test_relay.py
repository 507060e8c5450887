"""The relay end to end on 127.0.0.1: a real RelayServer in-process, RelayReservation as the worker's side,
an echo server as the worker's port, and raw sockets for the clients that misbehave."""

from __future__ import annotations

import json
import logging
import os
import random
import select
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from agora_client.relay import KeptReservation, RelayReservation, RelayServer, RelaySettings, RelayUnavailable
from agora_client.relay.protocol import split_address

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 5.0


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def no_relay_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every test also checks that nothing in the relay or its client logged an error (a swallowed bug)."""
    yield
    errors = [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith("agora_client.relay") and record.levelno >= logging.ERROR
    ]
    assert errors == []


class EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)
        self.request.shutdown(socket.SHUT_WR)  # answer the half-close: the relay must pass it both ways


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), EchoHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def settings(**overrides) -> RelaySettings:
    low = random.randrange(40000, 59000)  # ports in use are skipped by the relay
    return RelaySettings(
        **{"host": "127.0.0.1", "port": 0, "public_host": "127.0.0.1", "port_lo": low, "port_hi": low + 30, **overrides}
    )


@pytest.fixture
def relay() -> Iterator[RelayServer]:
    with RelayServer(settings()) as server:
        yield server


def control_address(server: RelayServer) -> str:
    return f"127.0.0.1:{server.port}"


def connect(address: str) -> socket.socket:
    return socket.create_connection(split_address(address), timeout=WAIT_S)


def read_line(sock: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    return json.loads(data)


def read_to_end(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def raw_reserve(server: RelayServer, peer_id: str = "raw") -> tuple[socket.socket, str]:
    """A control connection that reserves and then answers nothing."""
    sock = connect(control_address(server))
    sock.sendall(json.dumps({"v": 1, "op": "reserve", "peer_id": peer_id}).encode() + b"\n")
    answer = read_line(sock)
    assert answer["ok"] is True, answer
    return sock, answer["address"]


def assert_refused(address: str) -> None:
    with pytest.raises(ConnectionRefusedError):
        connect(address).close()


def test_a_connection_to_the_public_port_reaches_the_worker(relay: RelayServer, echo_port: int):
    with RelayReservation(control_address(relay), echo_port, on_lost=print, peer_id="QmWorker") as reservation:
        address = reservation.open()
        assert 0 < reservation.rtt_s < WAIT_S
        [info] = relay.reservations()
        assert (info.peer_id, info.address) == ("QmWorker", address) and info.since <= time.time()
        with connect(address) as peer:
            peer.sendall(b"hello through the relay")
            assert peer.recv(100) == b"hello through the relay"
        wait_until(lambda: reservation.bytes_relayed == 2 * len(b"hello through the relay"), "the byte count")


def test_five_megabytes_cross_both_ways_intact(relay: RelayServer, echo_port: int):
    payload = os.urandom(5 * 1024 * 1024)
    with RelayReservation(control_address(relay), echo_port, on_lost=print) as reservation:
        with connect(reservation.open()) as peer:

            def send() -> None:
                peer.sendall(payload)
                peer.shutdown(socket.SHUT_WR)  # the echo server sees the end only if the relay passes the half-close

            sender = threading.Thread(target=send)
            sender.start()
            echoed = read_to_end(peer)
            sender.join(timeout=WAIT_S)
        assert echoed == payload
        wait_until(lambda: relay.reservations()[0].bytes == 2 * len(payload), "the relay's byte count")
        assert reservation.bytes_relayed == 2 * len(payload)


def test_close_releases_the_reservation_at_once(relay: RelayServer, echo_port: int):
    lost = []
    reservation = RelayReservation(control_address(relay), echo_port, on_lost=lost.append)
    address = reservation.open()
    peer = connect(address)
    peer.sendall(b"x")
    assert peer.recv(1) == b"x"
    reservation.close()
    reservation.close()  # idempotent
    wait_until(lambda: relay.reservations() == [], "the release")
    assert_refused(address)
    assert read_to_end(peer) == b""  # the spliced connection was closed too
    peer.close()
    assert lost == []


def test_a_killed_control_connection_releases_the_reservation(relay: RelayServer):
    sock, address = raw_reserve(relay)
    assert len(relay.reservations()) == 1
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    sock.close()
    wait_until(lambda: relay.reservations() == [], "the release")
    assert_refused(address)


def test_on_lost_is_called_once_when_the_relay_goes_away(echo_port: int):
    lost: list[str] = []
    called = threading.Event()
    server = RelayServer(settings()).start()
    try:
        reservation = RelayReservation(
            control_address(server), echo_port, on_lost=lambda reason: (lost.append(reason), called.set())
        )
        reservation.open()
    finally:
        server.stop()
    assert called.wait(WAIT_S)
    reservation.close()
    assert len(lost) == 1 and "relay" in lost[0]


def test_a_released_port_goes_back_only_to_the_worker_that_asks_for_it(relay: RelayServer, echo_port: int):
    sock, address = raw_reserve(relay, "first")
    sock.close()
    wait_until(lambda: relay.reservations() == [], "the release")
    _, other = raw_reserve(relay, "newcomer")  # the released port is held back from others
    assert other != address
    with RelayReservation(control_address(relay), echo_port, on_lost=print) as again:
        assert again.open(port=int(address.rpartition(":")[2])) == address
    with RelayReservation(control_address(relay), echo_port, on_lost=print) as taken:
        assert taken.open(port=int(other.rpartition(":")[2])) not in (other, address)  # held by the newcomer


def test_a_kept_reservation_gets_its_port_back_after_the_relay_restarts(echo_port: int):
    events: list[tuple] = []
    restored = threading.Event()
    first = RelayServer(settings()).start()
    kept = KeptReservation(
        control_address(first),
        echo_port,
        waits=[0.05],
        on_lost=lambda reason: events.append(("lost", reason)),
        on_restored=lambda address, same: (events.append(("restored", address, same)), restored.set()),
    )
    try:
        address = kept.open()
        first.stop()  # the relay restarts: same control port, same public ports, no memory of the reservation
        with RelayServer(settings(port=first.port, port_lo=first.settings.port_lo, port_hi=first.settings.port_hi)):
            assert restored.wait(WAIT_S), events
            assert [event[0] for event in events] == ["lost", "restored"] and events[1][1:] == (address, True)
            with connect(address) as peer:
                peer.sendall(b"back")
                assert peer.recv(16) == b"back"
    finally:
        kept.close()


def test_a_kept_reservation_closed_while_the_relay_is_down_stops_trying(echo_port: int):
    lost = threading.Event()
    server = RelayServer(settings()).start()
    kept = KeptReservation(
        control_address(server),
        echo_port,
        waits=[0.05],
        on_lost=lambda reason: lost.set(),
        on_restored=lambda address, same: None,
    )
    kept.open()
    server.stop()
    assert lost.wait(WAIT_S)
    kept.close()
    wait_until(
        lambda: "relay-reserve-again" not in [thread.name for thread in threading.enumerate()], "the retries to end"
    )


def test_a_worker_that_answers_pings_stays_and_a_silent_one_is_released(echo_port: int):
    with RelayServer(settings(ping_every_s=0.2)) as server:
        with RelayReservation(control_address(server), echo_port, on_lost=print, peer_id="alive") as alive:
            alive.open()
            silent, address = raw_reserve(server, "silent")
            wait_until(
                lambda: [info.peer_id for info in server.reservations()] == ["alive"], "the silent one's release"
            )
            assert read_line(silent) == {"op": "ping"}  # it was pinged before being released
            silent.close()
            assert_refused(address)


def test_per_address_and_total_bounds_refuse_clearly(echo_port: int):
    for bounds, words in (
        ({"per_address": 2}, "too many reservations from 127.0.0.1"),
        ({"max_reservations": 2, "per_address": 8}, "the relay is full"),
    ):
        with RelayServer(settings(**bounds)) as server:
            held = [RelayReservation(control_address(server), echo_port, on_lost=print) for _ in range(2)]
            for reservation in held:
                reservation.open()
            with pytest.raises(RelayUnavailable, match=words):
                RelayReservation(control_address(server), echo_port, on_lost=print).open()
            held[0].close()
            wait_until(lambda: len(server.reservations()) == 1, "the release")
            held[0] = RelayReservation(control_address(server), echo_port, on_lost=print)
            held[0].open()  # room again once one is given back
            for reservation in held:
                reservation.close()


BAD_REQUESTS = {
    "not JSON": (b"hello garbage\n", "not JSON"),
    "not an object": (b"[1, 2]\n", "not a relay message"),
    "oversize line": (b"x" * 5000 + b"\n", "longer than 4096"),
    "oversize, no newline": (b"x" * 100_000, "longer than 4096"),
    "other version": (b'{"v": 2, "op": "reserve", "peer_id": "p"}\n', "version"),
    "unknown op": (b'{"v": 1, "op": "steal"}\n', "unknown op"),
    "empty peer id": (b'{"v": 1, "op": "reserve", "peer_id": ""}\n', "peer_id"),
    "unknown accept id": (
        b'{"v": 1, "op": "accept", "id": "00112233445566778899aabbccddeeff"}\n',
        "unknown or expired",
    ),
}


@pytest.mark.parametrize("request_bytes, words", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_get_an_error_and_the_relay_keeps_serving(
    relay: RelayServer, echo_port: int, request_bytes: bytes, words: str
):
    with connect(control_address(relay)) as sock:
        sock.sendall(request_bytes)
        answer = read_line(sock)
        assert answer["ok"] is False and words in answer["error"]
        assert read_to_end(sock) == b""  # and closed
    with RelayReservation(control_address(relay), echo_port, on_lost=print) as reservation:
        with connect(reservation.open()) as peer:
            peer.sendall(b"still here")
            assert peer.recv(100) == b"still here"


def test_a_connection_that_sends_nothing_is_answered_and_closed():
    with RelayServer(settings(hello_timeout_s=0.2)) as server:
        with connect(control_address(server)) as sock:
            answer = read_line(sock)
            assert answer["ok"] is False and "no request within" in answer["error"]
            assert read_to_end(sock) == b""


def accept_line(connect_message: dict) -> bytes:
    assert connect_message["op"] == "connect" and len(connect_message["id"]) == 32
    return json.dumps({"v": 1, "op": "accept", "id": connect_message["id"]}).encode() + b"\n"


def test_only_the_reserving_address_may_accept_and_each_id_once():
    with RelayServer(settings()) as server:
        control, address = raw_reserve(server)
        with connect(address) as peer:
            accept = accept_line(read_line(control))
            with socket.create_connection(
                ("127.0.0.1", server.port), timeout=WAIT_S, source_address=("127.0.0.2", 0)
            ) as stranger:
                stranger.sendall(accept)
                assert "unknown or expired" in read_line(stranger)["error"]
                assert read_to_end(stranger) == b""
            with connect(control_address(server)) as worker:  # the reserving address: spliced
                worker.sendall(accept)
                peer.sendall(b"ping over the splice")
                assert worker.recv(100) == b"ping over the splice"
                with connect(control_address(server)) as again:
                    again.sendall(accept)
                    assert "unknown or expired" in read_line(again)["error"]  # single use
        control.close()


def test_a_connect_nobody_accepts_is_closed_after_the_pending_timeout():
    with RelayServer(settings(pending_timeout_s=0.3)) as server:
        control, address = raw_reserve(server)
        with connect(address) as peer:
            accept = accept_line(read_line(control))
            assert read_to_end(peer) == b""
        with connect(control_address(server)) as late:
            late.sendall(accept)
            assert "unknown or expired" in read_line(late)["error"]
        control.close()


def test_connections_past_the_pending_cap_are_closed_at_once():
    with RelayServer(settings(max_pending=2, pending_timeout_s=30)) as server:
        control, address = raw_reserve(server)
        waiting = [connect(address) for _ in range(2)]
        for _ in waiting:
            accept_line(read_line(control))
        with connect(address) as third:
            assert read_to_end(third) == b""  # long before the 30 s pending timeout (the socket times out at 5)
        for peer in waiting:
            peer.close()
        control.close()


def test_an_unreachable_or_silent_or_garbled_relay_is_reported_within_the_timeout(echo_port: int):
    free = socket.create_server(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()
    with pytest.raises(RelayUnavailable, match="cannot reach the relay"):
        RelayReservation(f"127.0.0.1:{closed_port}", echo_port, on_lost=print).open()
    with pytest.raises(RelayUnavailable, match="bad relay address"):
        RelayReservation("no-port-here", echo_port, on_lost=print).open()
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts into the backlog; nothing answers
        started = time.monotonic()
        with pytest.raises(RelayUnavailable, match="did not answer within"):
            RelayReservation(f"127.0.0.1:{mute.getsockname()[1]}", echo_port, on_lost=print, timeout_s=0.3).open()
        assert time.monotonic() - started < 2


def test_a_garbled_answer_is_reported(echo_port: int):
    with socket.create_server(("127.0.0.1", 0)) as garbled:

        def answer_garbage() -> None:
            connection, _ = garbled.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"HTTP/1.1 400 Bad Request\n")

        server = threading.Thread(target=answer_garbage)
        server.start()
        with pytest.raises(RelayUnavailable, match="failed the reservation: not JSON"):
            RelayReservation(f"127.0.0.1:{garbled.getsockname()[1]}", echo_port, on_lost=print).open()
        server.join(timeout=WAIT_S)


def test_the_relay_command_serves_and_stops_on_ctrl_c(echo_port: int):
    low = settings().port_lo
    command = [
        sys.executable,
        str(REPO / "agora_cli.py"),
        "relay",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--public-host",
        "127.0.0.1",
        "--ports",
        f"{low}-{low + 30}",
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
        assert select.select([process.stdout], [], [], 30)[0], "no ready line within 30 s"
        ready = process.stdout.readline()
        assert ready.startswith("[RELAY] listening on 127.0.0.1:"), ready
        assert ready.rstrip().endswith(f"for public 127.0.0.1, ports {low}-{low + 30}")
        port = int(ready.removeprefix("[RELAY] listening on 127.0.0.1:").split()[0])
        with RelayReservation(f"127.0.0.1:{port}", echo_port, on_lost=print, peer_id="QmCli") as reservation:
            with connect(reservation.open()) as peer:
                peer.sendall(b"via the command")
                assert peer.recv(100) == b"via the command"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "Traceback" not in out + err
    assert "QmCli" in err and "bytes relayed" in err  # the release line
