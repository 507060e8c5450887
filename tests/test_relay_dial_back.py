"""The auth service's dial-back through a relay: the relay takes every connection to the port it holds for a
worker, so only the worker's libp2p host answering through it (it speaks first) makes the worker reachable; and the
relay pass the service gives with a failed dial-back, which is what the relay asks of a reserve."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth import (
    AdmissionPolicy,
    Authorization,
    AuthServer,
    AuthService,
    PeerUnreachable,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    write_demo_token_file,
)
from agora_client.auth.reachability import LIBP2P_HELLO, dial_back, parse_announce
from agora_client.auth.relay_pass import issue_relay_pass, verify_relay_pass
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.auth.tickets import generate_signing_key, load_or_create_signing_key, public_key_text
from agora_client.config import load_config
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.events import EventWriter
from agora_client.relay import PeerCredentials, RelayReservation, RelayServer, RelaySettings, RelayUnavailable

AUTH_KEY = generate_signing_key()
PEER_KEY = RSAPrivateKey()


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
    settings = RelaySettings(
        host="127.0.0.1",
        public_host="127.0.0.1",
        port_lo=47900,
        port_hi=47950,
        auth_public_key=public_key_text(AUTH_KEY),
    )
    server = RelayServer(settings).start()
    yield f"127.0.0.1:{server.port}"
    server.stop()


def _dial_through(relay: str, worker_port: int) -> tuple[bool, str]:
    peer_id = PeerCredentials(PEER_KEY, str).peer_id
    relay_pass = issue_relay_pass(AUTH_KEY, identity="alice", peer_id=peer_id)
    credentials = PeerCredentials(PEER_KEY, lambda: relay_pass)
    reservation = RelayReservation(relay, worker_port, on_lost=lambda reason: None, credentials=credentials)
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


def test_relay_pass_comes_with_a_failed_dial_back_and_serves_only_its_key(tmp_path):
    """The whole path on 127.0.0.1: a real auth service (dial-back and key proof on) whose run lists a real relay;
    the 409 to an unreachable joiner carries a pass for its key, which reserves a port there, and the join through
    that port is admitted; the same pass in another key's reserve is refused."""
    state = tmp_path / "state"
    auth_key = public_key_text(load_or_create_signing_key(state / "signing_key.pem"))  # the service loads this one
    relay_settings = RelaySettings(host="127.0.0.1", port_lo=47951, port_hi=47990, auth_public_key=auth_key)
    token_file = tmp_path / "tokens.json"
    token = write_demo_token_file(token_file, "alice")
    greeter = _serve(_Greeter)  # the worker's libp2p port
    with RelayServer(relay_settings) as relay, _auth_service(tmp_path, f"127.0.0.1:{relay.port}", token_file) as auth:
        peer_id = PeerCredentials(PEER_KEY, str).peer_id
        with pytest.raises(PeerUnreachable) as unreachable:
            _join(auth.url, token, peer_id, port=_closed_port())
        relay_pass = unreachable.value.relay_pass
        claims = verify_relay_pass(auth_key, relay_pass)
        assert (claims.peer_id, claims.identity) == (peer_id, "alice")
        thief = PeerCredentials(RSAPrivateKey(), lambda: relay_pass)
        with pytest.raises(RelayUnavailable, match="the relay pass is for peer id"):
            RelayReservation(f"127.0.0.1:{relay.port}", greeter.server_address[1], print, credentials=thief).open()
        owner = PeerCredentials(PEER_KEY, lambda: relay_pass)
        with RelayReservation(f"127.0.0.1:{relay.port}", greeter.server_address[1], print, credentials=owner) as held:
            granted = _join(auth.url, token, peer_id, announce=held.open())
            assert granted.dial.reachable and granted.identity == "alice"
    greeter.shutdown()


@contextmanager
def _auth_service(tmp_path, relay: str, token_file) -> Iterator[AuthServer]:
    config = load_config("tiny2")
    tokenizer = load_run_tokenizer(config)
    run = describe_run(
        config, ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",), None, None, TokenizerSummary.of(tokenizer), (relay,)
    )
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=run.config.model.stage_names, pacing_s=0.0),
        run=run,
        dial_back=True,
        dial_timeout_s=2.0,
        key_proof=True,
        tokenizer_json=tokenizer.content,
    )
    with AuthServer(AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")) as server:
        yield server


def _join(url: str, token: str, peer_id: str, **where) -> Authorization:
    return authorize(url, token, peer_id, events=EventWriter(), poll_every=0.05, peer_key=PEER_KEY, **where)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once it is closed
