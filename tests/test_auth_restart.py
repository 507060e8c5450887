"""A restart loses nothing: slots, queue places, pacing and peer bindings are committed per decision in the
auth service's SQLite state (agora_client/auth/state_store.py) and a restarted service carries on from them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth import write_demo_token_file
from agora_client.auth.admission import AdmissionPolicy, Admitted, Queued, SlotBook
from agora_client.auth.bindings import BindingFileError, PeerBindings
from agora_client.auth.key_proof import peer_id_of_public_key, sign_join
from agora_client.auth.secret import Secret
from agora_client.auth.state_store import AuthStateStore, open_book
from agora_client.auth.tickets import verify_ticket

REPO = Path(__file__).resolve().parents[1]
POLICY = AdmissionPolicy(
    stages=("head", "tail"),
    max_workers_per_stage=4,
    per_identity_cap=4,
    pacing_s=10.0,
    max_pending_per_stage=5,
    integration_timeout_s=100.0,
    ticket_ttl_s=50.0,
    queue_stale_s=30.0,
)


def reopened(path: Path, now: float) -> SlotBook:
    return open_book(AuthStateStore(path), POLICY, now)


def by_key(state):
    return (
        sorted(
            (slot.stage, slot.index, slot.identity, slot.peer_id, slot.admitted_at, slot.expires_at, slot.active)
            for slot in state.slots
        ),
        [(entry.queue_id, entry.stage, entry.peer_id, entry.joined_at) for entry in state.queue],
        state.last_admissions,
    )


# -- the store -------------------------------------------------------------------------------------------


def test_slots_queue_pacing_and_bindings_round_trip(tmp_path: Path):
    path = tmp_path / "auth_state.sqlite3"
    store = AuthStateStore(path)
    book = open_book(store, POLICY, now=0.0)
    first, second = book.join("alice", "pa", now=0.0), book.join("bob", "pb", now=1.0)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)  # one per stage: head, tail
    waiting = [book.join(name, f"p{name}", now=2.0) for name in ("carol", "dave", "erin")]
    assert [(place.entry.stage, place.position) for place in waiting] == [("head", 1), ("tail", 1), ("head", 2)]
    assert book.mark_active("head", 0, "pa", now=3.0)
    assert store.bind("pa", "alice") == "alice" and store.bind("pa", "mallory") == "alice"
    committed = store.load_book()
    store.close()  # the process could end here: the next one reads the same file

    again = AuthStateStore(path)
    assert by_key(again.load_book()) == by_key(committed) and len(committed.queue) == 3
    assert again.owner("pa") == "alice" and again.owner("pz") is None
    restored = open_book(again, POLICY, now=4.0)
    assert restored.occupancy(4.0) == book.occupancy(4.0)
    assert restored.renew("head", 0, "pa", now=5.0).expires_at == 55.0  # the slot is alice's still
    assert restored.renew("head", 0, "pb", now=5.0) is None  # and no one else's
    assert restored.poll(waiting[2].entry.queue_id, "perin", now=5.0).position == 2
    admitted = restored.poll(waiting[0].entry.queue_id, "pcarol", now=10.5)  # pacing counts from the saved admission
    assert isinstance(admitted, Admitted) and admitted.slot.index == 1 and admitted.waited_s == pytest.approx(8.5)

    last = reopened(path, now=11.0)  # the admission out of the queue was committed too
    assert last.poll(waiting[2].entry.queue_id, "perin", now=11.0).position == 1
    assert {slot.peer_id for slot in AuthStateStore(path).load_book().slots} == {"pa", "pb", "pcarol"}


def test_a_downtime_costs_no_queue_place_but_tickets_keep_their_expiry(tmp_path: Path):
    path = tmp_path / "auth_state.sqlite3"
    book = reopened(path, now=0.0)
    book.join("alice", "pa", now=0.0)
    book.join("bob", "pb", now=0.0)
    place = book.join("carol", "pc", now=1.0)
    assert isinstance(place, Queued)
    # Down for 40 s, longer than a place stays unpolled (30 s) and shorter than a ticket lives (50 s).
    restored = reopened(path, now=41.0)
    turn = restored.poll(place.entry.queue_id, "pc", now=42.0)  # its place kept, and now its turn
    assert isinstance(turn, Admitted) and turn.waited_s == 41.0
    assert restored.renew("head", 0, "pa", now=42.0) is not None
    # Down past the tickets' expiry: their slots are gone, as the tickets are.
    assert reopened(path, now=100.0).renew("tail", 0, "pb", now=100.0) is None


def test_a_crash_between_decisions_loses_nothing_committed(tmp_path: Path):
    path = tmp_path / "auth_state.sqlite3"
    script = f"""
import itertools
from agora_client.auth.admission import AdmissionPolicy
from agora_client.auth.state_store import AuthStateStore, open_book
book = open_book(AuthStateStore({str(path)!r}), AdmissionPolicy(stages=("head", "tail"), max_workers_per_stage=10**6,
                 pacing_s=0.0, max_pending_per_stage=10**6), now=0.0)
for n in itertools.count():
    book.join(f"id{{n}}", f"peer{{n}}", now=float(n))
    print(n, flush=True)
"""
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        answered = [int(child.stdout.readline()) for _ in range(30)]
        child.send_signal(signal.SIGKILL)  # mid-decision, most likely mid-transaction
    finally:
        child.kill()
        child.communicate(timeout=30)
    assert answered == list(range(30))
    peers = {slot.peer_id for slot in AuthStateStore(path).load_book().slots}
    assert {f"peer{n}" for n in answered} <= peers  # every decision answered was committed
    assert peers == {f"peer{n}" for n in range(len(peers))}  # and no half of one


def test_the_old_binding_file_is_imported_once_and_the_database_wins(tmp_path: Path):
    store = AuthStateStore(tmp_path / "auth_state.sqlite3")
    store.bind("PeerY", "bob")
    legacy = tmp_path / "peer_bindings.json"
    legacy.write_text(json.dumps({"PeerX": "alice", "PeerY": "carol"}))
    bindings = PeerBindings(store, legacy_file=legacy)
    assert bindings.owner("PeerX") == "alice" and bindings.owner("PeerY") == "bob"
    assert (
        not legacy.exists() and json.loads((tmp_path / "peer_bindings.json.migrated").read_text())["PeerX"] == "alice"
    )
    assert bindings.claim("PeerX", "mallory") == "alice"
    assert PeerBindings(AuthStateStore(tmp_path / "auth_state.sqlite3"), legacy_file=legacy).owner("PeerX") == "alice"
    legacy.write_text("{not json")
    with pytest.raises(BindingFileError, match="peer_bindings.json cannot be read .*restore it from a backup"):
        PeerBindings(store, legacy_file=legacy)


def test_a_damaged_database_is_one_clear_error(tmp_path: Path):
    path = tmp_path / "auth_state.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(
        ValueError, match="cannot be read as the auth service's state database.*restore it from a backup"
    ):
        AuthStateStore(path)


# -- the real service, killed and started again ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_service(tmp_path: Path, port: int) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        str(REPO / "agora_cli.py"),
        "auth",
        "--identity",
        "token-file",
        "--token-file",
        str(tmp_path / "tokens.json"),
        "--state-dir",
        str(tmp_path / "state"),
        "--config",
        "tiny",
        "--no-dial-back",
        "--port",
        str(port),
        "--pacing",
        "600",
        "--max-workers-per-stage",
        "2",
        "--snapshot-url",
        "http://127.0.0.1:9/s",
    ]
    log = open(tmp_path / "auth.log", "a")
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    log.close()
    ready = process.stdout.readline()
    assert ready.startswith("[AUTH] listening on "), ready + (tmp_path / "auth.log").read_text()
    return process, ready.removeprefix("[AUTH] listening on ").strip()


def test_a_killed_auth_service_restarts_with_its_slots_queue_and_tickets(tmp_path: Path):
    names = ("ann", "ben", "cat", "dan", "eve")
    tokens = {name: write_demo_token_file(tmp_path / "tokens.json", name) for name in names}
    keys = {name: RSAPrivateKey() for name in names}
    peers = {name: peer_id_of_public_key(keys[name].get_public_key().to_bytes()) for name in names}

    def join(url: str, name: str) -> dict:
        proof = sign_join(keys[name], peers[name], Secret(tokens[name]), time.time())
        reply = httpx.post(f"{url}/v1/join", json={"token": tokens[name], "peer_id": peers[name], **proof}, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()

    port = free_port()
    processes = []
    try:
        first, url = start_service(tmp_path, port)
        processes.append(first)
        granted = {name: join(url, name) for name in names[:4]}  # the first of each of tiny's four stages is let in
        assert [granted[name]["stage"] for name in names[:4]] == ["head", "body1", "body2", "tail"]
        queued = join(url, "eve")  # each stage admits once per 600 s: eve waits for the tail, shortest for its compute
        assert (queued["status"], queued["stage"], queued["position"]) == ("queued", "tail", 1)
        assert httpx.post(f"{url}/v1/active", json={"ticket": granted["ann"]["ticket"]}).status_code == 200
        before = httpx.get(f"{url}/v1/status").json()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)

        second, url = start_service(tmp_path, port)
        processes.append(second)
        assert httpx.get(f"{url}/v1/status").json() == before  # same occupancy, queue and signing key
        renewed = httpx.post(f"{url}/v1/renew", json={"ticket": granted["ann"]["ticket"]}).json()
        claims = verify_ticket(before["public_key"], renewed["ticket"])
        assert (claims.peer_id, claims.stage, claims.slot) == (peers["ann"], "head", granted["ann"]["slot"])
        assert renewed["expires_at"] >= granted["ann"]["expires_at"]
        polled = httpx.post(
            f"{url}/v1/join/poll", json={"queue_id": queued["queue_id"], "peer_id": peers["eve"]}
        ).json()
        assert (polled["status"], polled["queue_id"], polled["position"]) == ("queued", queued["queue_id"], 1)
        assert 0 < polled["estimated_wait_s"] <= queued["estimated_wait_s"]  # pacing still counts from the first run
    finally:
        for process in processes:
            process.kill()
            process.communicate(timeout=30)
