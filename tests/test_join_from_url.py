"""Joining from the swarm's URL alone: run description, stable peer key, key-to-account binding, slot
reclaim, dial-back reachability, GPU mapping and preflight. Real HTTP servers and sockets on 127.0.0.1."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.auth import (
    AdmissionPolicy,
    AuthFailed,
    AuthRejected,
    AuthServer,
    AuthService,
    PeerUnreachable,
    Secret,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    write_demo_token_file,
)
from agora_client.auth.admission import Admitted, Queued, Rejected, SlotBook
from agora_client.auth.key_proof import peer_id_of_public_key, sign_join
from agora_client.auth.presence import PresenceWatcher
from agora_client.auth.reachability import AnnounceError, advice, default_host_port, dial_back, parse_announce
from agora_client.auth.run_description import (
    RunChanged,
    RunDescription,
    RunDescriptionError,
    TokenizerSummary,
    check_unchanged,
    describe_run,
    fetch_description,
    parse_description,
)
from agora_client.config import load_config
from agora_client.data.tokenizer import load_run_tokenizer
from agora_client.events import MACHINE_CHECKS, EventWriter, PreflightEvent, ReachabilityEvent, parse_event
from agora_client.frontend.lines import LineFormatter
from agora_client.joining.peer_key import PeerKeyError, key_path, load_or_create_peer_key, peer_id_of
from agora_client.joining.preflight import (
    check_disk,
    check_download_rate,
    check_gpu,
    check_host_ram,
    check_seed_rtt,
    machine_checks,
    reachability_result,
)
from agora_client.snapshots import save_stage_snapshot, serve_directory
from agora_client.system.gpu import CardId, _parse_bus_id, match_cuda_index

REPO = Path(__file__).resolve().parent.parent
SEEDS = ("/ip4/127.0.0.1/tcp/4001/p2p/QmSeedA", "/ip4/127.0.0.1/tcp/4002/p2p/QmSeedB")


def describe(
    preset: str, seeds: tuple[str, ...] = SEEDS, snapshot_url: str | None = None, monitor_url: str | None = None
) -> RunDescription:
    """The preset's run description as the auth service makes it, with the preset's tokenizer."""
    config = load_config(preset)
    return describe_run(config, seeds, snapshot_url, monitor_url, TokenizerSummary.of(load_run_tokenizer(config)))


@contextmanager
def service(tmp_path: Path, *, dial_back_on: bool = False, key_proof_on: bool = False, config: str = "tiny2", **policy):
    token_file = tmp_path / "tokens.json"
    tokens = {name: write_demo_token_file(token_file, name) for name in ("alice", "bob")}
    run = describe(config, SEEDS, "http://127.0.0.1:1/snaps", "http://127.0.0.1:2")
    policy = {"stages": run.config.model.stage_names, "pacing_s": 0.0, "max_pending_per_stage": 100, **policy}
    settings = ServiceSettings(
        policy=AdmissionPolicy(**policy),
        seeds=SEEDS,
        poll_every_s=0.05,
        run=run,
        dial_back=dial_back_on,
        dial_timeout_s=2.0,
        key_proof=key_proof_on,
        tokenizer_json=load_run_tokenizer(run.config).content,
    )
    auth = AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")
    with AuthServer(auth) as server:
        yield server, tokens


@contextmanager
def listening():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once it is closed


# -- item 1: the run description ------------------------------------------------------------------------


def test_description_carries_the_full_run_and_a_hash(tmp_path):
    with service(tmp_path) as (server, _):
        run = fetch_description(server.url)
    assert run.config == load_config("tiny2") and run.config != load_config("tiny")
    assert (
        run.seeds == SEEDS
        and run.snapshot_url == "http://127.0.0.1:1/snaps"
        and run.monitor_url == "http://127.0.0.1:2"
    )
    assert (
        run.hash.startswith("sha256:") and run.hash == describe("tiny2", SEEDS, run.snapshot_url, run.monitor_url).hash
    )
    other = describe("tiny", SEEDS, run.snapshot_url, run.monitor_url)
    assert other.hash != run.hash


def test_a_description_that_does_not_match_its_hash_or_lacks_seeds_is_refused():
    good = describe("tiny2").to_json()
    altered = json.loads(json.dumps(good))
    altered["config"]["optim"]["lr"] = 1.0
    with pytest.raises(RunDescriptionError, match="does not match its hash"):
        parse_description(altered, "test")
    with pytest.raises(RunDescriptionError, match="no seed"):
        parse_description({**good, "seeds": []}, "test")
    with pytest.raises(RunDescriptionError, match="version 1 run description"):
        parse_description({"hello": 1}, "test")
    assert parse_description(good, "test").config.name == "tiny2"


def test_unreadable_description_and_a_changed_hash_are_clear_errors(tmp_path):
    with pytest.raises(RunDescriptionError, match="could not read the run description"):
        fetch_description(f"http://127.0.0.1:{closed_port()}")
    with service(tmp_path) as (server, _):
        joined = fetch_description(server.url)
        check_unchanged(server.url, joined)  # same run: no error
        auth = server.service
        auth.settings = replace(auth.settings, run=describe("tiny"))
        with pytest.raises(RunChanged, match="changed while this worker ran"):
            check_unchanged(server.url, joined)
        auth.settings = replace(auth.settings, run=None)
        with pytest.raises(RunDescriptionError, match="HTTP 503"):
            fetch_description(server.url)


# -- item 2: stable identity ------------------------------------------------------------------------------


def test_peer_key_is_created_once_mode_0600_and_reused(tmp_path):
    path = key_path(tmp_path, "gpu1")
    assert path == tmp_path / "identity" / "gpu1.key"
    first = load_or_create_peer_key(path)
    peer = peer_id_of(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chmod(path, 0o644)
    again = load_or_create_peer_key(path)
    assert again.to_bytes() == first.to_bytes() and peer_id_of(path) == peer
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    load_or_create_peer_key(key_path(tmp_path, "gpu0"))
    assert peer_id_of(key_path(tmp_path, "gpu0")) != peer  # one key per GPU
    path.write_bytes(b"not a key")
    with pytest.raises(PeerKeyError, match="not a usable peer key"):
        load_or_create_peer_key(path)


def test_the_worker_dht_runs_on_the_stored_key(tmp_path):
    """In a fresh process: hivemind's process-wide key (metrics signatures) and the DHT's peer id are the stored key."""
    path = key_path(tmp_path, "cpu")
    load_or_create_peer_key(path)
    script = f"""
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.dht.crypto import RSASignatureValidator
from agora_client.joining.peer_key import load_or_create_peer_key, peer_id_of
from agora_client.engine.identity import use_as_process_key
from agora_client.auth.key_proof import peer_id_of_public_key
from agora_client.monitor.records import signed_dht_kwargs
key = load_or_create_peer_key({str(path)!r})
use_as_process_key(key)
signed_dht_kwargs({str(path)!r})
owner = RSASignatureValidator().local_public_key
print(peer_id_of({str(path)!r}), peer_id_of_public_key(owner.split(b"[owner:")[1].rstrip(b"]")))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    stored, signer = out.stdout.split()
    assert stored == signer == peer_id_of(path)


def test_a_key_belongs_to_the_account_that_first_used_it_across_service_restarts(tmp_path):
    with service(tmp_path) as (server, tokens):
        assert (
            authorize(server.url, tokens["alice"], "PeerAlice", events=EventWriter(), poll_every=0.05).identity
            == "alice"
        )
        buffer = io.StringIO()
        with pytest.raises(AuthRejected, match="belongs to another Hugging Face account, not to bob"):
            authorize(server.url, tokens["bob"], "PeerAlice", events=EventWriter(buffer), poll_every=0.05)
        assert '"status":"rejected"' in buffer.getvalue()
    with service(tmp_path) as (server, tokens):  # a restarted service remembers the binding
        with pytest.raises(AuthRejected, match="belongs to another Hugging Face account"):
            authorize(server.url, tokens["bob"], "PeerAlice", events=EventWriter(), poll_every=0.05)
        assert authorize(server.url, tokens["bob"], "PeerBob", events=EventWriter(), poll_every=0.05).identity == "bob"
    assert stat.S_IMODE((tmp_path / "state" / "auth_state.sqlite3").stat().st_mode) == 0o600


def test_a_join_must_be_signed_by_the_key_of_its_peer_id(tmp_path):
    alice_key, bob_key = RSAPrivateKey(), RSAPrivateKey()
    alice_peer, bob_peer = (peer_id_of_public_key(key.get_public_key().to_bytes()) for key in (alice_key, bob_key))

    def join(token, peer_id, key=None):
        return authorize(server.url, token, peer_id, events=EventWriter(), poll_every=0.05, peer_key=key)

    with service(tmp_path, key_proof_on=True) as (server, tokens):
        # Bob learned Alice's new peer id before her first join: he cannot bind it, with no key or with his own.
        with pytest.raises(AuthRejected, match="prove it holds its peer key"):
            join(tokens["bob"], alice_peer)
        with pytest.raises(AuthRejected, match=f"is the key of peer id {bob_peer}, not of {alice_peer}"):
            join(tokens["bob"], alice_peer, bob_key)
        # Nor can he replay a proof Alice made for her token, nor send one that is stale or garbled.
        now = time.time()
        signed_by_alice = sign_join(alice_key, alice_peer, Secret(tokens["alice"]), now)
        refusals = {
            "does not verify": signed_by_alice,
            "s off the service's clock": sign_join(alice_key, alice_peer, Secret(tokens["bob"]), now - 3600),
            "not an RSA public key": {**signed_by_alice, "peer_key": "ssh-rsa AAAAnotakey"},
            "must be short text": {**signed_by_alice, "signed_at": "yesterday"},
        }
        for reason, proof in refusals.items():
            reply = httpx.post(f"{server.url}/v1/join", json={"token": tokens["bob"], "peer_id": alice_peer, **proof})
            assert reply.status_code == 403 and reply.json()["status"] == "rejected", reply.text
            assert reason in reply.json()["reason"]
        garbled = {**signed_by_alice, "key_proof": "é" + signed_by_alice["key_proof"][1:]}
        reply = httpx.post(f"{server.url}/v1/join", json={"token": tokens["alice"], "peer_id": alice_peer, **garbled})
        assert reply.status_code == 403 and "does not verify" in reply.json()["reason"]
        # Alice's own signed join is admitted, and the key is hers from now on.
        assert join(tokens["alice"], alice_peer, alice_key).identity == "alice"
        assert join(tokens["bob"], bob_peer, bob_key).identity == "bob"
    audit = [json.loads(line) for line in (tmp_path / "state" / "joins.jsonl").read_text().splitlines()]
    assert sum(line["event"] == "bad_key_proof" for line in audit) == 7


def book(**overrides) -> SlotBook:
    policy = {
        "stages": ("head", "tail"),
        "max_workers_per_stage": 3,
        "per_identity_cap": 2,
        "pacing_s": 10.0,
        "max_pending_per_stage": 1,
        "integration_timeout_s": 100.0,
        **overrides,
    }
    return SlotBook(AdmissionPolicy(**policy))


def test_a_restarted_peer_gets_its_own_slot_back_at_once():
    slots = book()
    first = slots.join("alice", "pa", now=0.0)
    assert isinstance(first, Admitted)
    slots.mark_active(first.slot.stage, first.slot.index, "pa", now=5.0)
    assert isinstance(slots.join("bob", "pb", now=6.0), Admitted)  # tail
    assert isinstance(slots.join("carol", "pc", now=7.0), Queued)  # pacing holds the next join
    again = slots.join("alice", "pa", now=8.0)  # the crashed client restarts: no pacing, same slot
    assert isinstance(again, Admitted) and (again.slot.stage, again.slot.index) == (first.slot.stage, first.slot.index)
    assert slots.occupancy(8.0)[first.slot.stage]["active"] + slots.occupancy(8.0)[first.slot.stage]["pending"] == 1
    assert isinstance(slots.join("alice", "pa2", now=9.0), Queued)  # the cap counts the restart once: 2 of 2
    assert isinstance(slots.join("alice", "pa3", now=9.0), Rejected)


def test_a_vanished_peer_is_freed_but_an_integrating_one_is_kept():
    slots = book(pacing_s=0.0, max_pending_per_stage=5, per_identity_cap=1)
    gone = slots.join("alice", "pa", now=0.0).slot
    slots.mark_active(gone.stage, gone.index, "pa", now=1.0)
    integrating = slots.join("bob", "pb", now=1.0).slot
    slots.observe({gone.stage: {"pa"}}, now=10.0, vanish_s=60.0)
    assert slots.observe({}, now=69.0, vanish_s=60.0) == []  # seen at 10: not gone long enough
    freed = slots.observe({}, now=70.0, vanish_s=60.0)
    assert [slot.peer_id for slot in freed] == ["pa"]  # bob is still within its integration timeout
    assert isinstance(slots.join("alice", "pa-new", now=71.0), Admitted)  # her cap is free again
    assert slots.observe({}, now=integrating.admitted_at + 100.0 + 60.0, vanish_s=60.0)[0].peer_id == "pb"
    # The watcher reads the rosters (here a stand-in for the DHT read) and hands them to the book.
    later = lambda: 1000.0  # noqa: E731 - past pa-new's integration timeout, before its ticket expires
    PresenceWatcher(slots, ("head", "tail"), lambda stage: {"pa-new"}, vanish_s=60.0, clock=later).check_once()
    assert sum(stage["active"] + stage["pending"] for stage in slots.occupancy(1000.0).values()) == 1
    PresenceWatcher(slots, ("head", "tail"), lambda stage: set(), vanish_s=0.0, clock=later).check_once()
    assert sum(stage["active"] + stage["pending"] for stage in slots.occupancy(1000.0).values()) == 0


# -- item 3: reachability ---------------------------------------------------------------------------------


def test_default_ports_and_announce_parsing():
    assert (default_host_port(None), default_host_port(0), default_host_port(3)) == (49200, 49200, 49203)
    assert parse_announce("203.0.113.7:50000") == ("203.0.113.7", 50000)
    assert parse_announce("[2001:db8::1]:49200") == ("2001:db8::1", 49200)
    for bad in ("203.0.113.7", "host:0", "host:99999", ":49200"):
        with pytest.raises(AnnounceError, match="HOST:PORT"):
            parse_announce(bad)


def test_dial_back_connects_for_real():
    with listening() as port:
        assert dial_back("127.0.0.1", port).reachable
    result = dial_back("127.0.0.1", closed_port(), timeout_s=2.0)
    assert not result.reachable and result.error == "refused" and "127.0.0.1" in result.tested_from
    lines = advice(result, announced=False)
    assert str(result.port) in lines[0] and "tested from 127.0.0.1" in lines[0]
    assert any("firewall" in line for line in lines) and any("security group" in line for line in lines)
    assert any("forward" in line for line in lines) and any("--announce-addr" in line for line in lines)


def test_the_service_admits_only_a_peer_it_can_dial_back(tmp_path):
    with service(tmp_path, dial_back_on=True) as (server, tokens):
        port = closed_port()
        with pytest.raises(PeerUnreachable) as caught:
            authorize(server.url, tokens["alice"], "PeerA", events=EventWriter(), poll_every=0.05, port=port)
        assert caught.value.dial.port == port and caught.value.dial.error == "refused"
        assert server.service.status()["occupied"] == 0  # nothing admitted
        with pytest.raises(AuthFailed, match="names no port"):
            authorize(server.url, tokens["alice"], "PeerA", events=EventWriter(), poll_every=0.05)
        with pytest.raises(AuthFailed, match="not the address your join came from"):
            authorize(server.url, tokens["alice"], "PeerA", events=EventWriter(), announce="192.0.2.1:40000")
        with listening() as open_port:
            granted = authorize(
                server.url,
                tokens["alice"],
                "PeerA",
                events=EventWriter(),
                poll_every=0.05,
                announce=f"127.0.0.1:{open_port}",
            )
        assert granted.identity == "alice" and granted.dial.reachable and granted.dial.port == open_port
    audit = (tmp_path / "state" / "joins.jsonl").read_text()
    assert '"event": "unreachable"' in audit


# -- item 4: --gpu N is the same card in NVML and CUDA -------------------------------------------------


def test_nvml_card_is_found_in_cuda_numbering_by_uuid_then_pci():
    cuda = [CardId("bbbb", (0, 2, 0)), CardId("aaaa", (0, 1, 0))]  # CUDA numbers the faster card first
    assert match_cuda_index(CardId("aaaa", (0, 1, 0)), cuda) == 1
    assert match_cuda_index(CardId(None, (0, 2, 0)), [CardId(None, (0, 1, 0)), CardId(None, (0, 2, 0))]) == 1
    assert match_cuda_index(CardId("cccc", (0, 3, 0)), cuda) is None  # hidden by CUDA_VISIBLE_DEVICES
    assert _parse_bus_id("00000000:3B:00.0") == (0, 0x3B, 0)
    assert _parse_bus_id("garbage") is None


# -- item 5: preflight ----------------------------------------------------------------------------------


def test_preflight_checks_measure_for_real(tmp_path):
    run = describe("tiny2")
    assert check_gpu("cpu", "no --gpu given").status == "warn"
    assert check_host_ram(run, on_cpu=True).status in ("pass", "warn")
    disk = check_disk(run, tmp_path / "cfg")
    assert disk.status == "pass" and "free in" in disk.value
    assert check_download_rate(run).status == "warn"  # no snapshot server named
    torch.manual_seed(0)
    module = torch.nn.Linear(256, 256)
    save_stage_snapshot(tmp_path / "store", "head", module, torch.optim.AdamW(module.parameters()), epoch=1, keep=1)
    with serve_directory(tmp_path / "store") as store:
        rate = check_download_rate(replace(run, snapshot_url=store.url))
    assert rate.status in ("pass", "warn") and "/s over" in rate.value and not rate.value.startswith("0 B/s")
    with listening() as port:
        rtt = check_seed_rtt(
            replace(run, seeds=(f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/QmX", f"/ip4/127.0.0.1/tcp/{port}/p2p/QmY"))
        )
    assert rtt.status == "pass" and "1 of 2 seeds answering" in rtt.value
    dead = check_seed_rtt(replace(run, seeds=(f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/QmX",)))
    assert dead.status == "fail" and "outbound" in dead.reason


def test_a_snapshot_server_down_warns_and_a_missing_snapshot_fails_the_download_check():
    """The download rides out an outage of the snapshot server (network/outage.py): so does its preflight check."""
    run = replace(describe("tiny2"), snapshot_url=f"http://127.0.0.1:{closed_port()}/snaps")
    refused = check_download_rate(run)
    assert refused.status == "warn" and "ConnectError" in refused.reason and "waits for it" in refused.reason
    for status, expected in ((503, "warn"), (502, "warn"), (404, "fail")):
        answering = httpx.Client(transport=httpx.MockTransport(lambda request, status=status: httpx.Response(status)))
        with answering:
            assert check_download_rate(run, client=answering).status == expected, status


def test_the_machine_checks_run_in_the_order_the_event_contract_lists(tmp_path):
    run = describe("tiny2", ())
    checks = machine_checks(run, f"http://127.0.0.1:{closed_port()}", "cpu", "no --gpu given", tmp_path)
    assert [check().check for check in checks] == list(MACHINE_CHECKS)


def test_preflight_and_reachability_lines_for_headless_and_the_app():
    formatter = LineFormatter()
    lines = formatter.format(PreflightEvent(check="disk", status="fail", value="1.0 GB free", reason="not enough disk"))
    assert [line.render() for line in lines] == ["[PREFLIGHT] disk: FAIL 1.0 GB free (not enough disk)"]
    result = dial_back("127.0.0.1", closed_port(), timeout_s=2.0)
    event = ReachabilityEvent(
        status="unreachable",
        address=result.address,
        port=result.port,
        tested_from=result.tested_from,
        error=result.error,
        advice=advice(result, announced=False),
        retry_in_s=30,
    )
    rendered = [line.render() for line in formatter.format(event)]
    assert rendered[0].startswith(f"[REACHABILITY] The swarm could not connect to your worker at {result.address}")
    assert rendered[-1] == "[REACHABILITY] Not joining while unreachable; trying again in 30s"
    relay_next = event.model_copy(update={"retry_in_s": None, "trying_relay": True})
    relay_line = formatter.format(relay_next)[-1].render()
    assert relay_line == "[REACHABILITY] Not reachable directly; trying the run's relay now"
    assert reachability_result(result, result.port).status == "fail"


def _runtime_exit(*args: str) -> tuple[int, list[dict]]:
    out = subprocess.run(
        [sys.executable, str(REPO / "agora_cli.py"), "runtime", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_TOKEN": "hf_test"},
        cwd=REPO,
    )
    return out.returncode, [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_the_runtime_exits_cleanly_when_the_description_cannot_be_read_or_the_announce_is_bad(tmp_path):
    code, events = _runtime_exit("--cpu", "--swarm", f"http://127.0.0.1:{closed_port()}", "--config-dir", str(tmp_path))
    assert code == 1 and events[-1]["kind"] == "exit"
    assert "could not read the run description" in events[-1]["reason"] and "hf_test" not in json.dumps(events)
    code, events = _runtime_exit(
        "--cpu", "--swarm", "http://127.0.0.1:1", "--announce-addr", "nowhere", "--config-dir", str(tmp_path)
    )
    assert code == 2 and "is not HOST:PORT" in events[-1]["reason"]


def test_the_runtime_refuses_to_fall_back_to_the_cpu(tmp_path):
    """Without a usable CUDA GPU the runtime stops with the reason; only --cpu (the demo, the tests) runs on the CPU."""
    cases = [((), "no GPU chosen")] + (
        [] if torch.cuda.is_available() else [(("--gpu", "0"), "CUDA is not available to torch")]
    )
    for device_args, why in cases:
        code, events = _runtime_exit(*device_args, "--swarm", "http://127.0.0.1:1", "--config-dir", str(tmp_path))
        assert code == 1 and events[-1]["kind"] == "exit", events
        assert why in events[-1]["reason"] and "A worker needs a usable CUDA GPU" in events[-1]["reason"]
        assert "--cpu runs the worker on the CPU" in next(e["hint"] for e in events if e["kind"] == "error")
    code, events = _runtime_exit("--cpu", "--swarm", f"http://127.0.0.1:{closed_port()}", "--config-dir", str(tmp_path))
    assert code == 1 and "could not read the run description" in events[-1]["reason"]  # --cpu got past the device


def test_a_runtime_that_cannot_start_fails_no_join_step_in_the_app(tmp_path):
    """No usable GPU is a failure to start, shown as such: authorization was never tried, so no step is marked."""
    from tui.state import JoinStep, JoinTracker
    from tui.widgets.stepper import Stepper

    code, events = _runtime_exit("--swarm", "http://127.0.0.1:1", "--config-dir", str(tmp_path))
    error = next(event for event in events if event["kind"] == "error")
    assert code == 1 and error["where"] == "start-up"
    tracker = JoinTracker()
    tracker.apply(parse_event(json.dumps(error)))
    assert tracker.failure is not None and tracker.failure.step is None and tracker.step == JoinStep.AUTHORIZATION
    stepper = Stepper()
    stepper.show(tracker.step, tracker.failure, tracker.status)
    shown = stepper.render()
    assert "Starting the worker failed:" in shown and "no GPU chosen" in shown
    assert "Authorization failed" not in shown and "✖" not in shown and "● Authorization" not in shown


def test_the_app_tracker_offers_a_retry_while_unreachable():
    from tui.state import JoinTracker

    tracker = JoinTracker()
    assert tracker.apply(
        ReachabilityEvent(status="unreachable", address="10.0.0.2:49200", port=49200, advice=["open it"])
    )
    assert tracker.unreachable and "10.0.0.2:49200" in tracker.status and "r retries now" in tracker.status
    tracker.apply(ReachabilityEvent(status="checking", port=49200))
    assert tracker.unreachable and "Asking the swarm" in tracker.status  # the diagnosis stays up while it retries
    tracker.apply(ReachabilityEvent(status="reachable", address="10.0.0.2:49200", port=49200, tested_from="10.0.0.1"))
    assert not tracker.unreachable
