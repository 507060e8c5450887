"""The relay end to end on 127.0.0.1: a real RelayServer in-process, RelayReservation as the worker's side,
an echo server as the worker's port, and raw sockets for the clients that misbehave. Every reserve carries a relay
pass signed with a test auth key and is signed with a real libp2p RSA key (``test_relay_...``: who may reserve)."""

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
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth.relay_pass import issue_relay_pass
from agora_client.auth.tickets import generate_signing_key, issue_ticket, public_key_text
from agora_client.relay import (
    KeptReservation,
    PeerCredentials,
    RelayReservation,
    RelayServer,
    RelaySettings,
    RelayUnavailable,
)
from agora_client.relay.protocol import split_address
from agora_client.relay.server import network_of

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 5.0
AUTH_KEY = generate_signing_key()  # the auth service's: it signs relay passes and tickets
PEER_KEYS = [RSAPrivateKey() for _ in range(4)]  # workers' libp2p keys (RSA keys take a while to make)


def credentials(peer: int = 0, identity: str = "alice", ttl_s: float = 600.0, key=AUTH_KEY) -> PeerCredentials:
    """Peer ``peer``'s key and a relay pass for it from ``key``'s auth service."""
    holder = PeerCredentials(PEER_KEYS[peer], lambda: "")
    relay_pass = issue_relay_pass(key, identity=identity, peer_id=holder.peer_id, ttl_s=ttl_s)
    return PeerCredentials(PEER_KEYS[peer], lambda: relay_pass)


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
    defaults = {"host": "127.0.0.1", "port": 0, "public_host": "127.0.0.1", "port_lo": low, "port_hi": low + 30}
    return RelaySettings(**{**defaults, "auth_public_key": public_key_text(AUTH_KEY), **overrides})


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


def raw_reserve(server: RelayServer, peer: int = 0, **fields) -> tuple[socket.socket, str]:
    """A control connection that reserves (as ``peer``, with ``fields`` added) and then answers nothing."""
    sock = connect(control_address(server))
    sock.sendall(json.dumps({"v": 1, "op": "reserve", **credentials(peer).sign(), **fields}).encode() + b"\n")
    answer = read_line(sock)
    assert answer["ok"] is True, answer
    return sock, answer["address"]


def assert_refused(address: str) -> None:
    with pytest.raises(ConnectionRefusedError):
        connect(address).close()


def test_a_connection_to_the_public_port_reaches_the_worker(relay: RelayServer, echo_port: int):
    with RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=credentials()) as reservation:
        address = reservation.open()
        assert 0 < reservation.rtt_s < WAIT_S
        [info] = relay.reservations()
        assert (info.peer_id, info.address) == (credentials().peer_id, address) and info.since <= time.time()
        with connect(address) as peer:
            peer.sendall(b"hello through the relay")
            assert peer.recv(100) == b"hello through the relay"
        wait_until(lambda: reservation.bytes_relayed == 2 * len(b"hello through the relay"), "the byte count")


def test_five_megabytes_cross_both_ways_intact(relay: RelayServer, echo_port: int):
    payload = os.urandom(5 * 1024 * 1024)
    with RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=credentials()) as reservation:
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
    reservation = RelayReservation(control_address(relay), echo_port, on_lost=lost.append, credentials=credentials())
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
            control_address(server),
            echo_port,
            on_lost=lambda reason: (lost.append(reason), called.set()),
            credentials=credentials(),
        )
        reservation.open()
    finally:
        server.stop()
    assert called.wait(WAIT_S)
    reservation.close()
    assert len(lost) == 1 and "relay" in lost[0]


def test_relay_a_second_peer_asking_for_a_held_port_is_refused_while_the_owner_gets_it_back(
    relay: RelayServer, echo_port: int
):
    sock, address = raw_reserve(relay, 0)
    port = int(address.rpartition(":")[2])
    sock.close()
    wait_until(lambda: relay.reservations() == [], "the release")
    with pytest.raises(RelayUnavailable, match=f"port {port} is held for the peer that had it"):
        RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=credentials(1)).open(port=port)
    with RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=credentials(1)) as newcomer:
        assert newcomer.open() != address  # nor is it handed out unasked
    with RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=credentials(0)) as owner:
        assert owner.open(port=port) == address  # the same peer id, proved by the same key
    assert relay.refusal_counts()["port_held"] == 1


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
        credentials=credentials(),
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
        credentials=credentials(),
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
        with RelayReservation(control_address(server), echo_port, on_lost=print, credentials=credentials()) as alive:
            alive.open()
            silent, address = raw_reserve(server, 1)
            wait_until(
                lambda: [info.peer_id for info in server.reservations()] == [credentials(0).peer_id],
                "the silent one's release",
            )
            assert read_line(silent) == {"op": "ping"}  # it was pinged before being released
            silent.close()
            assert_refused(address)


def test_relay_per_network_per_identity_and_total_bounds_refuse_clearly(echo_port: int):
    for bounds, words in (
        ({"per_network": 2}, "too many reservations from 127.0.0.0/24"),
        ({"per_identity": 2}, "too many reservations for alice"),
        ({"max_reservations": 2, "per_network": 8}, "the relay is full"),
    ):
        with RelayServer(settings(**bounds)) as server:
            held = [
                RelayReservation(control_address(server), echo_port, on_lost=print, credentials=credentials())
                for _ in range(2)
            ]
            for reservation in held:
                reservation.open()
            with pytest.raises(RelayUnavailable, match=words):
                RelayReservation(control_address(server), echo_port, on_lost=print, credentials=credentials()).open()
            held[0].close()
            wait_until(lambda: len(server.reservations()) == 1, "the release")
            held[0] = RelayReservation(control_address(server), echo_port, on_lost=print, credentials=credentials())
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
    "no pass": (b'{"v": 1, "op": "reserve", "peer_id": "p"}\n', "no relay pass"),
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
    with RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=credentials()) as reservation:
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
        RelayReservation(f"127.0.0.1:{closed_port}", echo_port, on_lost=print, credentials=credentials()).open()
    with pytest.raises(RelayUnavailable, match="bad relay address"):
        RelayReservation("no-port-here", echo_port, on_lost=print, credentials=credentials()).open()
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts into the backlog; nothing answers
        started = time.monotonic()
        with pytest.raises(RelayUnavailable, match="did not answer within"):
            RelayReservation(
                f"127.0.0.1:{mute.getsockname()[1]}", echo_port, on_lost=print, timeout_s=0.3, credentials=credentials()
            ).open()
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
            RelayReservation(
                f"127.0.0.1:{garbled.getsockname()[1]}", echo_port, on_lost=print, credentials=credentials()
            ).open()
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
        "--auth-public-key",
        public_key_text(AUTH_KEY),
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
        assert select.select([process.stdout], [], [], 90)[0], "no ready line within 90 s"  # it loads hivemind
        ready = process.stdout.readline()
        assert ready.startswith("[RELAY] listening on 127.0.0.1:"), ready
        assert ready.rstrip().endswith(f"for public 127.0.0.1, ports {low}-{low + 30}")
        port = int(ready.removeprefix("[RELAY] listening on 127.0.0.1:").split()[0])
        with RelayReservation(f"127.0.0.1:{port}", echo_port, on_lost=print, credentials=credentials()) as reservation:
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
    assert credentials().peer_id in err and "bytes relayed" in err  # the release line


def refused_reserve(server: RelayServer, request: dict) -> str:
    """The relay's error for a reserve it refuses (the connection is closed after it)."""
    with connect(control_address(server)) as sock:
        sock.sendall(json.dumps({"v": 1, "op": "reserve", **request}).encode() + b"\n")
        answer = read_line(sock)
        assert answer["ok"] is False, answer
        assert read_to_end(sock) == b""
    return answer["error"]


def test_relay_a_reservation_without_a_pass_is_refused(relay: RelayServer, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="agora_client.relay")
    unsigned = {key: value for key, value in credentials().sign().items() if key != "pass"}
    assert "no relay pass" in refused_reserve(relay, unsigned)
    with pytest.raises(RelayUnavailable, match="no relay pass"):
        RelayReservation(control_address(relay), 9, on_lost=print, credentials=None).open()
    assert relay.reservations() == [] and relay.refusal_counts()["no_pass"] == 2
    assert sum("(no_pass)" in record.getMessage() for record in caplog.records) == 2  # each refusal is logged


def test_relay_a_pass_copied_to_another_key_is_refused(relay: RelayServer):
    victim, thief = credentials(0).sign(), PeerCredentials(PEER_KEYS[1], lambda: victim["pass"])
    stolen = thief.sign()
    # the thief names the victim's peer id and sends its own key: not the key that peer id derives from
    assert "is the key of peer id" in refused_reserve(relay, {**stolen, "peer_id": victim["peer_id"]})
    # it sends the victim's key too, but cannot sign with it
    forged = {**stolen, "peer_id": victim["peer_id"], "peer_key": victim["peer_key"]}
    assert "not signed by the key of peer id" in refused_reserve(relay, forged)
    # it keeps its own peer id: the pass names another
    assert "the relay pass is for peer id" in refused_reserve(relay, stolen)
    assert relay.reservations() == []
    assert relay.refusal_counts() == {"wrong_key": 1, "bad_signature": 1, "wrong_peer": 1}


def test_relay_an_expired_pass_or_one_from_another_auth_service_is_refused(relay: RelayServer, echo_port: int):
    expired = credentials(ttl_s=-1.0)
    with pytest.raises(RelayUnavailable, match="relay pass expired"):
        RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=expired).open()
    stranger = credentials(key=generate_signing_key())
    with pytest.raises(RelayUnavailable, match="signature does not match"):
        RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=stranger).open()
    assert relay.reservations() == []


def test_relay_a_replayed_or_stale_reserve_is_refused(relay: RelayServer):
    signed = credentials().sign()
    control, _ = raw_reserve(relay, **signed)  # a reserve seen on the wire, sent again
    assert "sent before" in refused_reserve(relay, signed)
    stale = credentials().sign(now=time.time() - 3600)
    assert "off the relay's clock" in refused_reserve(relay, stale)
    control.close()


def test_relay_an_admitted_workers_ticket_reserves_a_trainers_does_not(relay: RelayServer, echo_port: int):
    peer_id = credentials(2).peer_id

    def ticket(role: str) -> str:
        return issue_ticket(
            AUTH_KEY,
            identity="bob",
            peer_id=peer_id,
            stage="head" if role == "worker" else "trainer",
            slot=0,
            ttl_s=600,
            role=role,
        )

    worker = PeerCredentials(PEER_KEYS[2], lambda: ticket("worker"))
    with RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=worker) as reservation:
        reservation.open()
        assert [info.peer_id for info in relay.reservations()] == [peer_id]
    trainer = PeerCredentials(PEER_KEYS[2], lambda: ticket("trainer"))
    with pytest.raises(RelayUnavailable, match="a trainer's ticket is not a relay pass"):
        RelayReservation(control_address(relay), echo_port, on_lost=print, credentials=trainer).open()


def test_relay_connections_waiting_for_their_first_request_are_bounded():
    with RelayServer(settings(max_waiting=8, max_waiting_per_network=3, hello_timeout_s=30)) as server:
        waiting = [connect(control_address(server)) for _ in range(3)]
        with connect(control_address(server)) as fourth:
            assert read_to_end(fourth) == b""  # closed at once, long before the 30 s hello timeout
        for sock in waiting:
            sock.close()
        wait_until(lambda: server.refusal_counts().get("waiting") == 1, "the refusal's count")
        with RelayReservation(control_address(server), 9, on_lost=print, credentials=credentials()) as reservation:
            reservation.open()  # room again once they are gone


def test_relay_splices_per_reservation_are_bounded(echo_port: int):
    with RelayServer(settings(max_splices=2)) as server:
        with RelayReservation(control_address(server), echo_port, on_lost=print, credentials=credentials()) as held:
            address = held.open()
            carried = [connect(address) for _ in range(2)]
            for peer in carried:
                peer.sendall(b"x")
                assert peer.recv(1) == b"x"
            with connect(address) as third:
                assert read_to_end(third) == b""
            assert server.refusal_counts() == {"splices": 1}
            carried.pop().close()
            wait_until(lambda: _echoes(address), "room for one more splice")
            for peer in carried:
                peer.close()


def _echoes(address: str) -> bool:
    """Whether a new connection to ``address`` is carried (one the relay refuses is closed, maybe with a reset)."""
    try:
        with connect(address) as peer:
            peer.sendall(b"y")
            return peer.recv(1) == b"y"
    except ConnectionError:
        return False


def test_relay_an_idle_spliced_connection_is_closed(echo_port: int):
    with RelayServer(settings(idle_timeout_s=0.5)) as server:
        with RelayReservation(control_address(server), echo_port, on_lost=print, credentials=credentials()) as held:
            with connect(held.open()) as peer:
                for _ in range(3):  # bytes that keep moving keep it open past the idle time
                    peer.sendall(b"z")
                    assert peer.recv(1) == b"z"
                    time.sleep(0.3)
                started = time.monotonic()
                assert read_to_end(peer) == b""
                assert time.monotonic() - started < WAIT_S
            assert server.refusal_counts() == {"idle": 1}


@pytest.mark.parametrize(
    "address, network",
    [
        ("203.0.113.7", "203.0.113.0/24"),
        ("::ffff:203.0.113.200", "203.0.113.0/24"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ],
)
def test_relay_limits_count_ipv4_slash24_and_ipv6_slash64(address: str, network: str):
    assert network_of(address) == network


def test_relay_an_operators_worker_reserves_with_its_own_ticket_on_the_key_its_dht_runs_on(echo_port: int):
    from agora_client.auth.ticket_source import SelfIssuedTickets
    from agora_client.joining.peer_key import peer_id_of
    from agora_client.worker.relayed import reserve_relayed_port

    with RelayServer(settings()) as server:
        tickets = SelfIssuedTickets(AUTH_KEY, role="worker", stage="head")
        relayed, address = reserve_relayed_port(
            control_address(server), tickets, on_lost=print, on_restored=lambda address, same: None
        )
        with relayed:
            [info] = server.reservations()
            assert info.address == address and info.peer_id == peer_id_of(relayed.identity_path)
            assert relayed.dht_kwargs()["identity_path"] == str(relayed.identity_path)
        assert not relayed.identity_path.exists()
        wait_until(lambda: server.reservations() == [], "the release")
        with pytest.raises(RelayUnavailable, match="signature does not match"):  # another service's tickets
            reserve_relayed_port(
                control_address(server),
                SelfIssuedTickets(generate_signing_key(), role="worker", stage="head"),
                on_lost=print,
                on_restored=lambda address, same: None,
            )


def test_relay_a_pass_never_verifies_as_a_ticket_nor_a_ticket_as_a_pass():
    from agora_client.auth.relay_pass import verify_relay_pass
    from agora_client.auth.tickets import InvalidTicket, verify_ticket

    public_key = public_key_text(AUTH_KEY)
    relay_pass = issue_relay_pass(AUTH_KEY, identity="alice", peer_id="QmPeer")
    ticket = issue_ticket(AUTH_KEY, identity="alice", peer_id="QmPeer", stage="head", slot=0, ttl_s=600)
    assert verify_relay_pass(public_key, relay_pass).peer_id == verify_ticket(public_key, ticket).peer_id == "QmPeer"
    with pytest.raises(InvalidTicket, match="ticket signature does not match"):
        verify_ticket(public_key, relay_pass)
    with pytest.raises(InvalidTicket, match="relay pass signature does not match"):
        verify_relay_pass(public_key, ticket)


def test_relay_seen_nonces_are_bounded_in_time_and_number():
    from agora_client.relay.proof import MAX_SKEW_S, SeenNonces

    seen = SeenNonces(limit=3)
    assert [seen.first_time(nonce, 0.0) for nonce in ("a", "b", "a")] == [True, True, False]
    assert seen.first_time("a", 2 * MAX_SKEW_S + 1)  # past the window a nonce is forgotten (its time is refused)
    assert seen.first_time("c", 2 * MAX_SKEW_S + 2) and seen.first_time("d", 2 * MAX_SKEW_S + 2)
    assert not seen.first_time("d", 2 * MAX_SKEW_S + 2)
    assert seen.first_time("e", 2 * MAX_SKEW_S + 2)  # a fourth: the oldest, "a", makes room
    assert seen.first_time("a", 2 * MAX_SKEW_S + 2) and not seen.first_time("e", 2 * MAX_SKEW_S + 2)
