"""Auth service and client over real HTTP on 127.0.0.1: slots, capacity, identity cap, queue, tickets."""

from __future__ import annotations

import io
import json
import stat
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from agora_client.auth import (
    AdmissionPolicy,
    AuthFailed,
    AuthRejected,
    AuthServer,
    AuthService,
    HuggingFaceIdentity,
    InvalidTicket,
    InvalidToken,
    Secret,
    ServiceSettings,
    StageAssignment,
    TokenFileIdentity,
    authorize,
    generate_signing_key,
    issue_ticket,
    leave,
    load_signing_key,
    public_key_text,
    renew_ticket,
    report_active,
    save_signing_key,
    swarm_status,
    verify_ticket,
    write_demo_token_file,
)
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.config import load_config
from agora_client.events import AuthEvent, EventWriter, QueueEvent, parse_event

STAGES = ("head", "body1", "tail")


@contextmanager
def auth_service(
    tmp_path: Path, users=("alice", "bob", "carol"), *, snapshot_url="http://127.0.0.1:1/snaps", run=None, **policy
):
    token_file = tmp_path / "tokens.json"
    tokens = {name: write_demo_token_file(token_file, name) for name in users}
    stages = run.config.model.stage_names if run is not None else STAGES
    policy = {"stages": stages, "pacing_s": 0.0, "max_pending_per_stage": 100, **policy}
    settings = ServiceSettings(
        policy=AdmissionPolicy(**policy),
        snapshot_url=snapshot_url,
        seeds=("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",),
        poll_every_s=0.05,
        run=run,
    )
    service = AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")
    with AuthServer(service) as server:
        yield server, tokens


def join(server, token, peer_id, **kwargs):
    return authorize(server.url, token, peer_id, events=kwargs.pop("events", EventWriter()), poll_every=0.05, **kwargs)


def auth_events(buffer: io.StringIO):
    return [parse_event(line) for line in buffer.getvalue().splitlines()]


# -- tickets --------------------------------------------------------------------------------------------


def test_ticket_round_trip_and_rejections(tmp_path: Path):
    key = generate_signing_key()
    public = public_key_text(key)
    ticket = issue_ticket(key, identity="alice", peer_id="12D3KooWpeer", stage="body1", slot=3, ttl_s=60)
    claims = verify_ticket(public, ticket)
    assert (claims.identity, claims.peer_id, claims.stage, claims.slot) == ("alice", "12D3KooWpeer", "body1", 3)
    assert claims.expires_at == pytest.approx(claims.issued_at + 60)

    payload, signature = ticket.split(".")
    forged = issue_ticket(key, identity="mallory", peer_id="12D3KooWpeer", stage="body1", slot=3, ttl_s=60).split(".")[
        0
    ]
    with pytest.raises(InvalidTicket, match="signature") as tampered:
        verify_ticket(public, f"{forged}.{signature}")
    assert tampered.value.reason == "bad_signature"
    flipped = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
    with pytest.raises(InvalidTicket) as altered:
        verify_ticket(public, f"{flipped}.{signature}")
    assert altered.value.reason == "bad_signature"
    with pytest.raises(InvalidTicket) as other_service:
        verify_ticket(public_key_text(generate_signing_key()), ticket)
    assert other_service.value.reason == "bad_signature"
    with pytest.raises(InvalidTicket, match="expired") as expired:
        verify_ticket(public, ticket, now=claims.expires_at + 1)
    assert expired.value.reason == "expired"
    for garbage in ("", "no-dot", "a.b.c", "###.###", payload):
        with pytest.raises(InvalidTicket) as malformed:
            verify_ticket(public, garbage)
        assert malformed.value.reason in ("malformed", "bad_signature")
    with pytest.raises(ValueError, match="public key"):
        verify_ticket("not a key!", ticket)

    path = tmp_path / "keys" / "signing_key.pem"
    save_signing_key(key, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert public_key_text(load_signing_key(path)) == public
    path.write_text("garbage")
    with pytest.raises(ValueError, match="not an unencrypted PEM"):
        load_signing_key(path)


# -- admission ------------------------------------------------------------------------------------------


def test_join_returns_stage_seeds_snapshot_and_a_verifiable_ticket(tmp_path: Path):
    with auth_service(tmp_path) as (server, tokens):
        buffer = io.StringIO()
        granted = join(server, tokens["alice"], "peerA1", events=EventWriter(buffer))
        status = swarm_status(server.url)
    assert granted.stage == "head" and granted.identity == "alice" and granted.slot == 0
    assert granted.seeds == ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",)
    assert granted.snapshot_url == "http://127.0.0.1:1/snaps/head/latest.json"
    claims = verify_ticket(status["public_key"], granted.ticket)
    assert (claims.identity, claims.peer_id, claims.stage, claims.slot) == ("alice", "peerA1", "head", 0)
    assert status["stages"]["head"] == {"active": 0, "pending": 1, "queued": 0, "capacity": 8}
    assert status["capacity"] == 24 and status["occupied"] == 1 and status["queue_length"] == 0
    events = auth_events(buffer)
    assert [event.status for event in events] == ["authorizing", "authorized"]
    assert (events[1].identity, events[1].stage, events[1].slot) == ("alice", "head", 0)
    assert "ticket" not in repr(granted)


def test_stage_assignment_picks_the_emptiest_stage(tmp_path: Path):
    users = [f"user{i}" for i in range(6)]
    with auth_service(tmp_path, users=users) as (server, tokens):
        first = [join(server, tokens[f"user{i}"], f"peer{i}") for i in range(4)]
        assert [grant.stage for grant in first] == ["head", "body1", "tail", "head"]  # ties go to pipeline order
        assert leave(server.url, first[1].ticket) is True
        assert leave(server.url, first[1].ticket) is False  # already free
        assert join(server, tokens["user4"], "peer4").stage == "body1"  # the only stage with nobody
        assert join(server, tokens["user5"], "peer5").stage == "body1"  # body1 1, head 2, tail 1 -> body1 first


def test_a_gpu_is_given_only_a_stage_it_can_hold(tmp_path: Path):
    config = load_config("8b")
    llama3 = TokenizerSummary(
        "0" * 64, config.model.vocab_size, config.tokenizer.eos_token
    )  # offline: not fetched from the hub
    run = describe_run(config, ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",), None, None, llama3)
    gib = 1 << 30
    users = ["small", "mid1", "mid2", "large", "cpu"]
    with auth_service(tmp_path, users=users, run=run, max_workers_per_stage=1) as (server, tokens):
        with pytest.raises(
            AuthRejected, match=r"a GPU with 4\.00 GiB holds none of this swarm's stages: the smallest, body1, needs"
        ):
            join(server, tokens["small"], "peerS", gpu_memory=4 * gib)
        assert join(server, tokens["mid1"], "peerM1", gpu_memory=24 * gib).stage == "head"
        assert join(server, tokens["mid2"], "peerM2", gpu_memory=24 * gib).stage == "body1"
        assert join(server, tokens["large"], "peerL", gpu_memory=80 * gib).stage == "body2"
        assert join(server, tokens["cpu"], "peerC").stage == "body3"  # no GPU named: any stage (CPU demo workers)
    with auth_service(
        tmp_path / "full",
        users=["a", "b", "c", "d", "e", "f", "g"],
        run=run,
        max_workers_per_stage=1,
        per_identity_cap=8,
    ) as (server, tokens):
        for index, user in enumerate("abcdef"):  # head and the five bodies
            join(server, tokens[user], f"peer{index}", gpu_memory=48 * gib, host_memory=24 * gib)
        with pytest.raises(
            AuthRejected, match=r"every stage your GPU can hold \(head, body1, body2, body3, body4, body5\) is full"
        ):  # the tail's host needs (33 GiB in fp32) exceed 24 GiB of RAM
            join(server, tokens["g"], "peer7", gpu_memory=48 * gib, host_memory=24 * gib)
        assert join(server, tokens["g"], "peer8", gpu_memory=48 * gib, host_memory=64 * gib).stage == "tail"


def test_admission_weighs_gpu_and_host_memory_together(tmp_path: Path):
    config = load_config("8b")
    llama3 = TokenizerSummary("0" * 64, config.model.vocab_size, config.tokenizer.eos_token)
    run = describe_run(config, ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",), None, None, llama3)
    gib = 1 << 30
    only_tail = {"stages": ("tail", "body1"), "max_workers_per_stage": 1}
    with auth_service(tmp_path, users=["big", "home", "small"], run=run, **only_tail) as (server, tokens):
        # both stages empty: tail comes first by order, but a 48 GiB GPU on a 24 GiB host cannot keep its host side
        assert join(server, tokens["big"], "peerB", gpu_memory=48 * gib, host_memory=24 * gib).stage == "body1"
        # a 24 GiB home card on a 64 GiB PC takes the tail in the offload layout (bf16 weights on the GPU)
        assert join(server, tokens["home"], "peerH", gpu_memory=24 * gib, host_memory=64 * gib).stage == "tail"
    with auth_service(tmp_path / "tight", users=["small"], run=run, stages=("tail",)) as (server, tokens):
        # the tail alone on offer: the 48 GiB GPU holds it, its 24 GiB host does not (33 GiB in the fp32 layout)
        with pytest.raises(
            AuthRejected, match=r"24\.00 GiB of available RAM holds none of the stages its GPU can take"
        ):
            join(server, tokens["small"], "peerS", gpu_memory=48 * gib, host_memory=24 * gib)


def test_full_swarm_rejects_at_once_with_the_message(tmp_path: Path):
    users = ["u1", "u2", "u3", "u4"]
    with auth_service(tmp_path, users=users, max_workers_per_stage=1) as (server, tokens):
        for index in range(3):
            join(server, tokens[users[index]], f"p{index}")
        buffer = io.StringIO()
        started = time.monotonic()
        with pytest.raises(AuthRejected, match="the swarm is at capacity .*try again later"):
            join(server, tokens["u4"], "p3", events=EventWriter(buffer))
        assert time.monotonic() - started < 5  # no waiting list
        rejected = auth_events(buffer)[-1]
        assert rejected.status == "rejected" and "at capacity" in rejected.message
        assert swarm_status(server.url)["queue_length"] == 0


def test_per_identity_cap_holds(tmp_path: Path):
    with auth_service(tmp_path, per_identity_cap=2) as (server, tokens):
        join(server, tokens["alice"], "alice-gpu0")
        join(server, tokens["alice"], "alice-gpu1")
        with pytest.raises(AuthRejected, match="alice already runs 2 peers"):
            join(server, tokens["alice"], "alice-gpu2")
        assert join(server, tokens["bob"], "bob-gpu0").identity == "bob"  # other contributors are not affected
        # A restarted peer (same peer id) replaces its own slot instead of counting twice.
        assert join(server, tokens["alice"], "alice-gpu1").identity == "alice"
        assert swarm_status(server.url)["occupied"] == 3


def test_invalid_and_malformed_requests_get_clear_errors(tmp_path: Path):
    with auth_service(tmp_path) as (server, tokens), httpx.Client() as client:
        buffer = io.StringIO()
        with pytest.raises(AuthRejected, match="did not accept your token") as failed:  # exit code 3, no retry
            join(server, "hf_not_a_real_token", "peerX", events=EventWriter(buffer))
        assert "Traceback" not in str(failed.value)
        assert auth_events(buffer)[-1].status == "rejected"

        invalid = client.post(f"{server.url}/v1/join", json={"token": "hf_nope", "peer_id": "peerX"})
        assert invalid.status_code == 401 and "token" in invalid.json()["error"]
        not_json = client.post(f"{server.url}/v1/join", content=b"{not json")
        assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
        missing = client.post(f"{server.url}/v1/join", json={"token": tokens["bob"]})
        assert missing.status_code == 400 and "peer_id" in missing.json()["error"]
        bad_peer = client.post(f"{server.url}/v1/join", json={"token": tokens["bob"], "peer_id": "has spaces"})
        assert bad_peer.status_code == 400
        bad_ticket = client.post(f"{server.url}/v1/leave", json={"ticket": "x.y"})
        assert bad_ticket.status_code == 401 and "signature" in bad_ticket.json()["error"]
        assert client.get(f"{server.url}/nope").status_code == 404
        # The service is still up and serving.
        assert join(server, tokens["bob"], "peerB").identity == "bob"

    with pytest.raises(AuthFailed, match="could not reach the auth service"):
        join(server, tokens["bob"], "peerB")  # the service is stopped now


def test_queue_keeps_place_and_admits_later(tmp_path: Path):
    pacing = 1.5
    with (
        auth_service(tmp_path, stages=("head",), pacing_s=pacing, max_workers_per_stage=4) as (server, tokens),
        httpx.Client() as client,
    ):
        first = join(server, tokens["alice"], "first")
        assert first.stage == "head"
        # Two more joiners while the first is being integrated: they queue in order.
        second = client.post(f"{server.url}/v1/join", json={"token": tokens["bob"], "peer_id": "second"}).json()
        third = client.post(f"{server.url}/v1/join", json={"token": tokens["carol"], "peer_id": "third"}).json()
        assert (second["status"], second["position"], third["position"]) == ("queued", 1, 2)
        assert second["stage"] == "head" and second["snapshot_url"].endswith("/head/latest.json")
        assert 0 < second["estimated_wait_s"] <= pacing and third["estimated_wait_s"] > second["estimated_wait_s"]
        # Polling and re-joining keep the place.
        poll = client.post(
            f"{server.url}/v1/join/poll", json={"queue_id": second["queue_id"], "peer_id": "second"}
        ).json()
        assert (poll["status"], poll["position"]) == ("queued", 1)
        again = client.post(f"{server.url}/v1/join", json={"token": tokens["bob"], "peer_id": "second"}).json()
        assert (again["queue_id"], again["position"]) == (second["queue_id"], 1)
        third_poll = client.post(
            f"{server.url}/v1/join/poll", json={"queue_id": third["queue_id"], "peer_id": "third"}
        ).json()
        assert third_poll["position"] == 2
        wrong_peer = client.post(
            f"{server.url}/v1/join/poll", json={"queue_id": second["queue_id"], "peer_id": "third"}
        )
        assert wrong_peer.status_code == 404

        # The client waits with its place, logging position, and is admitted once pacing allows.
        buffer = io.StringIO()
        assigned: list[StageAssignment] = []
        started = time.monotonic()
        granted = join(
            server,
            tokens["bob"],
            "second",
            events=EventWriter(buffer),
            queue_log_every=0.2,
            on_assigned=assigned.append,
        )
        waited = time.monotonic() - started
        assert granted.stage == "head" and granted.identity == "bob" and granted.queued_s > 0
        assert waited >= pacing - 0.5
        assert assigned == [StageAssignment("head", "http://127.0.0.1:1/snaps/head/latest.json")]
        events = auth_events(buffer)
        queue_events = [event for event in events if isinstance(event, QueueEvent)]
        assert queue_events and all(event.position == 1 for event in queue_events)
        assert len(queue_events) <= waited / 0.2 + 2  # throttled to one per queue_log_every
        assert isinstance(events[-1], AuthEvent) and events[-1].status == "authorized"
        # The third joiner moved up to the front.
        third_poll = client.post(
            f"{server.url}/v1/join/poll", json={"queue_id": third["queue_id"], "peer_id": "third"}
        ).json()
        assert third_poll["status"] == "queued" and third_poll["position"] == 1
        assert join(server, tokens["carol"], "third").identity == "carol"


def test_pending_peer_holds_the_stage_until_it_reports_active(tmp_path: Path):
    with auth_service(tmp_path, stages=("head",), max_pending_per_stage=1) as (server, tokens):
        first = join(server, tokens["alice"], "first")
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(grant=join(server, tokens["bob"], "second")))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and swarm_status(server.url)["queue_length"] == 1
        report_active(server.url, first.ticket)
        waiter.join(timeout=10)
        assert result["grant"].identity == "bob"
        assert swarm_status(server.url)["stages"]["head"]["active"] == 1


def test_slots_expire_with_their_ticket_and_renewal_extends_them(tmp_path: Path):
    with auth_service(tmp_path, stages=("head",), max_workers_per_stage=1, ticket_ttl_s=2.0) as (server, tokens):
        kept = join(server, tokens["alice"], "kept")
        new_ticket, expires_at = renew_ticket(server.url, kept.ticket)
        assert expires_at > kept.expires_at and verify_ticket(kept.public_key, new_ticket).slot == kept.slot
        time.sleep(1.2)
        new_ticket, _ = renew_ticket(server.url, new_ticket)
        time.sleep(1.2)
        with pytest.raises(AuthRejected, match="capacity"):  # renewed: still held after the first ttl
            join(server, tokens["bob"], "other")
        time.sleep(1.6)
        assert swarm_status(server.url)["occupied"] == 0  # expired without renewal
        with pytest.raises(AuthFailed, match="expired"):
            renew_ticket(server.url, new_ticket)
        assert join(server, tokens["bob"], "other").identity == "bob"


def test_token_file_identity_reads_hashes_and_plain_tokens(tmp_path: Path):
    path = tmp_path / "tokens.yaml"
    token = write_demo_token_file(path, "demo")
    assert token not in path.read_text() and "demo" in path.read_text()
    source = TokenFileIdentity(path)
    assert source.resolve(Secret(token)) == "demo"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "plain-token-for-dave": "dave"}))
    assert source.resolve(Secret("plain-token-for-dave")) == "dave"  # re-read after the change
    with pytest.raises(InvalidToken):
        source.resolve(Secret("nope"))


# -- Hugging Face identity against a real whoami-v2 endpoint ----------------------------------------------


class WhoamiHandler(BaseHTTPRequestHandler):
    users = {"hf_goodtoken123": "alice-hf"}
    seen_paths: list[str] = []

    def do_GET(self):
        type(self).seen_paths.append(self.path)
        header = self.headers.get("Authorization", "")
        name = self.users.get(header.removeprefix("Bearer "))
        if self.path != "/api/whoami-v2" or name is None:
            body, status = json.dumps({"error": "Invalid credentials in Authorization header"}).encode(), 401
        else:
            body, status = (
                json.dumps(
                    {"type": "user", "name": name, "fullname": "Alice", "auth": {"type": "access_token"}}
                ).encode(),
                200,
            )
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), WhoamiHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_hugging_face_identity_uses_the_configured_endpoint(hub: str, monkeypatch, tmp_path: Path):
    WhoamiHandler.seen_paths = []
    assert HuggingFaceIdentity(hub).resolve(Secret("hf_goodtoken123")) == "alice-hf"
    with pytest.raises(InvalidToken, match="did not accept the Hugging Face token"):
        HuggingFaceIdentity(hub).resolve(Secret("hf_wrong"))
    monkeypatch.setenv("HF_ENDPOINT", hub)
    from_env = HuggingFaceIdentity()
    assert from_env.endpoint == hub and from_env.resolve(Secret("hf_goodtoken123")) == "alice-hf"
    assert WhoamiHandler.seen_paths == ["/api/whoami-v2"] * 3

    settings = ServiceSettings(policy=AdmissionPolicy(stages=STAGES, pacing_s=0), snapshot_url=None)
    with AuthServer(AuthService(settings, from_env, tmp_path / "state")) as server:
        granted = authorize(server.url, "hf_goodtoken123", "peerHF", events=EventWriter())
        assert granted.identity == "alice-hf" and granted.snapshot_url is None
        with pytest.raises(AuthRejected, match="did not accept"):
            authorize(server.url, "hf_wrong", "peerHF2", events=EventWriter())


def test_hugging_face_endpoint_down_is_a_503_not_an_invalid_token(tmp_path: Path):
    with ThreadingHTTPServer(("127.0.0.1", 0), WhoamiHandler) as probe:
        dead = f"http://127.0.0.1:{probe.server_address[1]}"
    settings = ServiceSettings(policy=AdmissionPolicy(stages=STAGES), snapshot_url=None)
    with AuthServer(AuthService(settings, HuggingFaceIdentity(dead, timeout_s=5), tmp_path / "state")) as server:
        reply = httpx.post(f"{server.url}/v1/join", json={"token": "hf_goodtoken123", "peer_id": "p"})
        assert reply.status_code == 503 and "could not reach" in reply.json()["error"]
