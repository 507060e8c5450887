"""TLS and reverse proxies at the services' front, and the client's refusal of plain http:// across the internet.

Real services on 127.0.0.1 with a certificate signed by a CA the test makes; real sockets from 127.0.0.x (this host's
loopback) standing in for a proxy and its clients; the runtime as a real process where its flags are what is tested.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import certifi
import httpx
import pytest
from cryptography.hazmat.primitives import serialization

from agora_client.auth import (
    AdmissionPolicy,
    AuthFailed,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    leave,
    renew_ticket,
    swarm_status,
    write_demo_token_file,
)
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.auth.transport import PlainHttpRefused, refuse_plain_http, trust_ca_certificate
from agora_client.config import load_config
from agora_client.events import EventWriter, parse_event
from agora_client.http_service import (
    PLAIN_HTTP,
    Exposure,
    HttpService,
    RateLimit,
    ServiceLimits,
    TlsSetupError,
    TrustedProxies,
    add_exposure_arguments,
    exposure_from_arguments,
    json_reply,
    server_tls_context,
)
from tests.test_http_service_limits import closed_by_server
from tests.tls_helpers import make_tls_files

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
STAGES = ("head", "body1", "tail")
INTERNET_URL = "http://11.77.0.2:8470"  # a public address: nothing here ever connects to it


@contextmanager
def auth_server(
    tmp_path: Path,
    *,
    exposure: Exposure = PLAIN_HTTP,
    snapshot_url: str | None = None,
    run=None,
    dial_back: bool = False,
    **server_options,
):
    token_file = tmp_path / "tokens.json"
    tokens = {name: write_demo_token_file(token_file, name) for name in ("alice", "bob", "carol")}
    settings = ServiceSettings(
        policy=AdmissionPolicy(
            stages=STAGES if run is None else run.config.model.stage_names, pacing_s=0.0, max_pending_per_stage=100
        ),
        snapshot_url=snapshot_url,
        poll_every_s=0.05,
        run=run,
        dial_back=dial_back,
        dial_timeout_s=2.0,
    )
    service = AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")
    with AuthServer(service, exposure=exposure, **server_options) as server:
        yield server, tokens


def tls_exposure(tmp_path: Path, **options) -> tuple[Exposure, Path]:
    files = make_tls_files(tmp_path / "tls")
    return Exposure(server_tls_context(files.server_cert, files.server_key), **options), files.ca_cert


def runtime_exit(*args: str) -> tuple[int, dict]:
    """The runtime's exit code and its last event (the exit, with the reason)."""
    env = {key: value for key, value in os.environ.items() if key != "SSL_CERT_FILE"}
    out = subprocess.run(
        [sys.executable, str(REPO / "agora_cli.py"), "runtime", "--cpu", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONPATH": str(REPO), "HF_TOKEN": "hf_test_token"},
        cwd=REPO,
    )
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert events and events[-1]["kind"] == "exit", out.stderr[-2000:]
    assert "hf_test_token" not in out.stdout + out.stderr
    return out.returncode, events[-1]


def post_join(
    server: AuthServer, token: str, peer_id: str, port: int, *, source: str, forwarded_for: str
) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=10) as client:
        return client.post(
            f"{server.url}/v1/join",
            json={"token": token, "peer_id": peer_id, "port": port},
            headers={"X-Forwarded-For": forwarded_for},
        )


def connect(url: str, source: str) -> socket.socket:
    host, port = url.partition("://")[2].split(":")
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


# -- TLS ------------------------------------------------------------------------------------------------


def test_a_join_over_tls_works_once_the_client_trusts_the_swarms_ca(tmp_path: Path, monkeypatch):
    exposure, ca_cert = tls_exposure(tmp_path)
    assert exposure.tls.minimum_version == ssl.TLSVersion.TLSv1_2
    with auth_server(tmp_path, exposure=exposure) as (server, tokens):
        assert server.url.startswith("https://127.0.0.1:")
        with pytest.raises(AuthFailed, match="TLS certificate is not trusted.*--ca-cert PEM"):
            authorize(server.url, tokens["alice"], "peerA", events=EventWriter())
        monkeypatch.setenv("SSL_CERT_FILE", certifi.where())  # the test's environment comes back afterwards
        bundle = tmp_path / "client" / "trusted-cas.pem"
        trust_ca_certificate(ca_cert, bundle)
        granted = authorize(server.url, tokens["alice"], "peerA", events=EventWriter(), poll_every=0.05)
        assert (granted.identity, granted.stage, granted.swarm_url) == ("alice", "head", server.url)
        ticket, _ = renew_ticket(server.url, granted.ticket)
        assert swarm_status(server.url)["occupied"] == 1
        assert leave(server.url, ticket)
        with connect(server.url, "127.0.0.1") as plain:  # plain HTTP to the TLS port gets no HTTP answer
            plain.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
            assert not plain.recv(1024).startswith(b"HTTP/")
    assert (
        ssl.create_default_context(cafile=str(bundle)).cert_store_stats()["x509_ca"] > 50
    )  # the usual CAs stay trusted


def test_the_runtime_trusts_its_ca_cert_and_says_what_to_do_without_it(tmp_path: Path):
    exposure, ca_cert = tls_exposure(tmp_path)
    with auth_server(tmp_path, exposure=exposure) as (server, _):  # no run description: it answers 503
        common = ("--swarm", server.url, "--config-dir", str(tmp_path / "client"))
        code, untrusted = runtime_exit(*common)
        assert (
            code == 1 and "TLS certificate is not trusted" in untrusted["reason"] and "--ca-cert" in untrusted["reason"]
        )
        code, trusted = runtime_exit(*common, "--ca-cert", str(ca_cert))
        assert code == 1 and "answered HTTP 503" in trusted["reason"], trusted  # reached the service over TLS
        code, not_a_certificate = runtime_exit(*common, "--ca-cert", str(tmp_path / "tls" / "server.key"))
        assert code == 2 and "--ca-cert" in not_a_certificate["reason"] and "PEM" in not_a_certificate["reason"]


def test_a_tls_handshake_counts_against_the_connection_caps_and_the_header_timeout(tmp_path: Path):
    exposure, ca_cert = tls_exposure(tmp_path)
    limits = ServiceLimits(header_timeout_s=1.0, max_connections_per_address=2)
    service = HttpService(
        lambda request: json_reply(200, {"status": "ok", "from": request.source}),
        "127.0.0.1",
        0,
        name="tls-test",
        limits=limits,
        exposure=exposure,
    ).start()
    try:
        silent = [connect(service.url, "127.0.0.2") for _ in range(2)]  # connected, never start the handshake
        time.sleep(0.2)
        assert service.open_connections == 2
        with connect(service.url, "127.0.0.2") as third:
            assert closed_by_server(third, 1.0)  # over the cap while the two shake no hands
        started = time.monotonic()
        assert all(closed_by_server(client, 3.0) for client in silent)
        assert 0.5 <= time.monotonic() - started <= 3.0
        verify = ssl.create_default_context(cafile=str(ca_cert))
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2", verify=verify), timeout=5) as client:
            assert client.get(f"{service.url}/").json() == {"status": "ok", "from": "127.0.0.2"}  # places given back
        for client in silent:
            client.close()
    finally:
        service.close()


def test_tls_flags_say_what_is_wrong(tmp_path: Path):
    files = make_tls_files(tmp_path / "tls")
    with pytest.raises(TlsSetupError, match="no such file"):
        server_tls_context(tmp_path / "missing.pem", files.server_key)
    with pytest.raises(TlsSetupError, match="private key that matches"):
        server_tls_context(files.server_cert, make_tls_files(tmp_path / "other").server_key)
    key = serialization.load_pem_private_key(files.server_key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(TlsSetupError, match="is encrypted: give it unencrypted"):  # not a prompt on the terminal
        server_tls_context(files.server_cert, encrypted)
    parser = argparse.ArgumentParser()
    add_exposure_arguments(parser)
    with pytest.raises(TlsSetupError, match="give both --tls-cert and --tls-key"):
        exposure_from_arguments(parser.parse_args(["--tls-cert", str(files.server_cert)]))
    served = exposure_from_arguments(
        parser.parse_args(
            ["--tls-cert", str(files.server_cert), "--tls-key", str(files.server_key), "--trusted-proxy", "10.0.0.0/8"]
        )
    )
    assert served.scheme == "https" and "10.1.2.3" in served.trusted_proxies


# -- the client's refusal of plain HTTP ------------------------------------------------------------------


def test_plain_http_to_a_host_on_the_internet_is_refused_without_insecure(tmp_path: Path):
    sent: list[httpx.Request] = []
    spy = httpx.Client(transport=httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500)))
    buffer = io.StringIO()
    with pytest.raises(AuthFailed) as refused:
        authorize(INTERNET_URL, "hf_secret_token", "peerA", events=EventWriter(buffer), client=spy)
    assert "11.77.0.2" in str(refused.value) and "token would cross the internet in clear text" in str(refused.value)
    assert "https://" in str(refused.value) and "--insecure" in str(refused.value)
    assert sent == [] and "hf_secret_token" not in buffer.getvalue()
    assert [parse_event(line).status for line in buffer.getvalue().splitlines()] == ["authorizing", "failed"]

    for local in (
        "http://127.0.0.1:8470",
        "http://[::1]:8470",
        "http://localhost:8470",
        "http://10.77.0.2:8470",
        "http://192.168.1.20:8470",
        "http://172.16.4.4",
        "http://[fd00::2]:80",
    ):
        refuse_plain_http(local, insecure=False, what="the swarm", why="test")
    refuse_plain_http("https://11.77.0.2:8470", insecure=False, what="the swarm", why="test")
    refuse_plain_http(INTERNET_URL, insecure=True, what="the swarm", why="test")
    with pytest.raises(PlainHttpRefused):
        refuse_plain_http("http://[::ffff:11.77.0.2]:8470", insecure=False, what="the swarm", why="test")

    code, exited = runtime_exit("--swarm", INTERNET_URL, "--config-dir", str(tmp_path))
    assert code == 2 and "clear text" in exited["reason"] and "--insecure" in exited["reason"]


def test_snapshots_and_the_monitor_on_plain_http_across_the_internet_are_refused_too(tmp_path: Path):
    with auth_server(tmp_path, snapshot_url="http://11.77.0.2:8080/snaps") as (server, tokens):
        with pytest.raises(AuthFailed, match="snapshot store at 11.77.0.2.*swap"):
            authorize(server.url, tokens["alice"], "peerA", events=EventWriter(), poll_every=0.05)
        granted = authorize(server.url, tokens["bob"], "peerB", events=EventWriter(), poll_every=0.05, insecure=True)
        assert granted.snapshot_url == f"http://11.77.0.2:8080/snaps/{granted.stage}/latest.json"

    config = load_config("tiny")
    summary = TokenizerSummary("0" * 64, config.model.vocab_size, config.tokenizer.eos_token)  # never fetched here
    run = describe_run(config, ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",), None, "http://11.77.0.2:8090", summary)
    with auth_server(tmp_path / "described", run=run) as (server, _):
        code, exited = runtime_exit("--swarm", server.url, "--config-dir", str(tmp_path / "client"))
    assert code == 2 and "monitor at 11.77.0.2" in exited["reason"] and "--insecure" in exited["reason"]


# -- reverse proxies ------------------------------------------------------------------------------------


def test_x_forwarded_for_from_a_trusted_proxy_sets_the_dial_back_target_and_is_ignored_from_anyone_else(tmp_path: Path):
    with socket.socket() as contributor:  # the contributor's worker port, at 127.0.0.3 only
        contributor.bind(("127.0.0.3", 0))
        contributor.listen(8)
        port = contributor.getsockname()[1]
        exposure = Exposure(trusted_proxies=TrustedProxies.parse(["127.0.0.1"]))
        with auth_server(tmp_path, exposure=exposure, dial_back=True) as (server, tokens):
            # The proxy at 127.0.0.1 appended the contributor's address; what the contributor wrote before it is not
            # believed.
            proxied = post_join(
                server, tokens["alice"], "peerA", port, source="127.0.0.1", forwarded_for="6.6.6.6, 127.0.0.3"
            )
            assert proxied.status_code == 200 and proxied.json()["status"] == "authorized", proxied.text
            assert proxied.json()["dial"]["host"] == "127.0.0.3"
            direct = post_join(server, tokens["bob"], "peerB", port, source="127.0.0.2", forwarded_for="127.0.0.3")
            assert (
                direct.status_code == 409 and direct.json()["dial"]["host"] == "127.0.0.2"
            )  # its own address, not the header's
        contributor.setblocking(False)
        contributor.accept()[0].close()  # the one dial-back that reached the contributor
        with pytest.raises(BlockingIOError):
            contributor.accept()
    audit = [json.loads(line) for line in (tmp_path / "state" / "joins.jsonl").read_text().splitlines()]
    assert [line["address"] for line in audit if line["event"] == "unreachable"] == [f"127.0.0.2:{port}"]


def test_rate_limits_and_connection_caps_count_the_proxys_clients_not_the_proxy(tmp_path: Path):
    exposure = Exposure(trusted_proxies=TrustedProxies.parse(["127.0.0.0/30"]))
    strict = RateLimit(per_minute=1, burst=1, exempt_loopback=False)
    limits = ServiceLimits(max_connections_per_address=2)
    with auth_server(tmp_path, exposure=exposure, join_rate=strict, limits=limits) as (server, tokens):
        first = post_join(server, tokens["alice"], "peerA", 1, source="127.0.0.1", forwarded_for="198.51.100.7")
        again = post_join(server, tokens["alice"], "peerA", 1, source="127.0.0.1", forwarded_for="198.51.100.7")
        other = post_join(server, tokens["bob"], "peerB", 1, source="127.0.0.2", forwarded_for="198.51.100.8")
        assert (first.status_code, again.status_code, other.status_code) == (200, 429, 200)
        held = [connect(server.url, "127.0.0.1") for _ in range(4)]  # the proxy: more than one client's share
        time.sleep(0.2)
        assert not any(closed_by_server(client, 0.05) for client in held)
        clients = [connect(server.url, "127.0.0.5") for _ in range(3)]  # a client straight in: two at most
        assert closed_by_server(clients[2], 2.0) and not closed_by_server(clients[0], 0.05)
        for client in held + clients:
            client.close()


def test_forwarded_for_is_read_from_the_right_through_trusted_proxies_only():
    proxies = TrustedProxies.parse(["10.0.0.0/24", "2001:db8::1"])
    assert proxies.client_address("10.0.0.5", ["203.0.113.9"]) == "203.0.113.9"
    assert proxies.client_address("10.0.0.5", ["1.1.1.1, 203.0.113.9, 10.0.0.7"]) == "203.0.113.9"  # two proxies deep
    assert proxies.client_address("10.0.0.5", ["1.1.1.1", "203.0.113.9:4711"]) == "203.0.113.9"  # two headers; a port
    assert proxies.client_address("::ffff:10.0.0.5", ["[2001:db8::7]:443"]) == "2001:db8::7"
    assert (
        proxies.client_address("203.0.113.50", ["10.0.0.1"]) == "203.0.113.50"
    )  # not a proxy: its header is not believed
    assert proxies.client_address("10.0.0.5", ["garbage"]) == "10.0.0.5"
    assert proxies.client_address("10.0.0.5", []) == "10.0.0.5"
    with pytest.raises(ValueError, match="--trusted-proxy 'proxy.example' is not an IP address or CIDR range"):
        TrustedProxies.parse(["proxy.example"])


def test_the_front_end_hands_insecure_and_ca_cert_to_the_runtime_which_takes_them(monkeypatch, tmp_path: Path):
    from agora_client import runtime as runtime_module
    from agora_client.cli import build_parser
    from agora_client.frontend.client import prepare

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    flags = ["--headless", "--swarm", INTERNET_URL, "--config-dir", str(tmp_path), "--insecure", "--ca-cert", "ca.pem"]
    flags.append("--allow-write-token")  # no Hugging Face here to ask what the token may do (test_token_scope.py)
    session = prepare(build_parser().parse_args(flags))
    assert not isinstance(session, int)
    argv = session.command.argv
    runtime_parser = argparse.ArgumentParser()
    runtime_module.configure(runtime_parser)
    runtime = runtime_parser.parse_args(list(argv[argv.index("runtime") + 1 :]))
    assert (runtime.swarm, runtime.insecure, runtime.ca_cert) == (INTERNET_URL, True, Path("ca.pem"))
    plain = runtime_parser.parse_args(["--swarm", INTERNET_URL])
    assert (plain.insecure, plain.ca_cert) == (False, None)


def test_tls_is_served_when_the_process_runs_uvloop(tmp_path: Path):
    """hivemind installs uvloop process-wide (its DHT and expert clients do): the services keep asyncio's own loop,
    whose TLS takeover of a paused connection the guard needs (under uvloop's, clients hung)."""
    import asyncio

    import uvloop

    exposure, ca_cert = tls_exposure(tmp_path)
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        service = HttpService(
            lambda request: json_reply(200, {"status": "ok"}), "127.0.0.1", 0, name="uvloop-test", exposure=exposure
        ).start()
    finally:
        asyncio.set_event_loop_policy(previous)
    try:
        verify = ssl.create_default_context(cafile=str(ca_cert))
        with httpx.Client(verify=verify, timeout=5) as client:
            assert client.get(f"{service.url}/").json() == {"status": "ok"}
        with connect(service.url, "127.0.0.1") as plain:  # plain HTTP to the TLS port: cut, never answered
            plain.settimeout(5)
            plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert not plain.recv(1024).startswith(b"HTTP/")
    finally:
        service.close()
