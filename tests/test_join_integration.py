"""A contributor joins a running local swarm: auth service, snapshot download, sync phases, active.

One swarm serves both tests: the runtime alone (the join path, checked from its events and from
the DHT), then the real Textual app supervising a real runtime until it shows Active.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from itertools import pairwise

import httpx
import psutil
import pytest
import yaml
from hivemind.dht.crypto import RSASignatureValidator

from agora_client.discovery.dht import connect_dht
from agora_client.discovery.roster import fetch_roster
from agora_client.events import json_objects
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions
from agora_client.swarm.processes import ManagedProcess
from tests.swarm_helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
PHASE1_STEPS, PHASE2_STEPS = 8, 4
# A round every 4 epochs: wider than the 3 x matchmaking_time a group may take (rounds due faster than
# groups form can miss each other). Phase 1 spans 2 rounds: every parameter averaged once, as in production.
SPARTA = {"period": 4, "fraction": 0.5}


@pytest.fixture(scope="module")
def join_swarm(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("join")
    preset = yaml.safe_load((resources.files("agora_client") / "presets" / "tiny.yaml").read_text())
    # phases long enough to observe, phase 1 too (tiny lets a fresh snapshot pass it at once: test_sync_state)
    preset["sync"].update(phase1_steps=PHASE1_STEPS, phase2_steps=PHASE2_STEPS, skip_phase1_when_fresh=False)
    preset["sparta"].update(SPARTA)
    preset_path = run_dir / "join.yaml"
    preset_path.write_text(yaml.safe_dump(preset))
    swarm = LocalSwarm(
        SwarmOptions(
            preset=str(preset_path), workers_per_stage=1, run_dir=run_dir, publish_snapshots=True, report_every=3
        )
    )
    try:
        swarm.start()
        auth_url, token = swarm.start_join_services(pacing=2.0)
        monitor_url = swarm.start_monitor(auth_url, interval=3.0)
        yield swarm, auth_url, token, preset_path, monitor_url
    finally:
        swarm.stop()


def _events(process: ManagedProcess) -> list[dict]:
    return json_objects(process.lines())


def _progress_samples(dht, stage: str, peer_id_bytes: bytes) -> int | None:
    entry = dht.get(f"agora.progress.{stage}_progress", latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return None
    for item in entry.value.values():
        value = item.value
        if isinstance(value, dict) and value.get("peer_id") == peer_id_bytes:
            return value["samples_accumulated"]
    return None


def test_joiner_passes_every_phase_in_order(join_swarm, tmp_path):
    swarm, auth_url, token, preset_path, monitor_url = join_swarm
    client_dir = tmp_path / "client"
    runtime = ManagedProcess(
        "runtime",
        [
            "runtime",
            "--cpu",
            "--swarm",
            auth_url,
            "--config-dir",
            str(client_dir),
            "--host-port",
            "0",
            "--monitor",
            monitor_url,
        ],
        tmp_path / "runtime.log",
        env={"HF_TOKEN": token},
    )
    # Progress records are signed: a peer without the validator cannot even decode them.
    observer = connect_dht(swarm.seed_addrs, record_validators=[RSASignatureValidator()])
    observations: list[tuple[int, int | None, int]] = []  # (phase before, samples, phase after)
    try:
        wait_until(lambda: any(e["kind"] == "stage" for e in _events(runtime)), 240, "the joiner's worker to start")
        stage_event = next(e for e in _events(runtime) if e["kind"] == "stage")
        stage, peer_id = stage_event["stage"], stage_event["peer_id"]
        from hivemind.p2p import PeerID

        peer_bytes = PeerID.from_base58(peer_id).to_bytes()

        def phase() -> int | None:
            record = fetch_roster(observer, stage).get(peer_id)
            return None if record is None else record.sync_phase

        def active_with_steps() -> bool:
            before = phase()
            samples = _progress_samples(observer, stage, peer_bytes)
            after = phase()
            if before is not None and after is not None:
                observations.append((before, samples, after))
            events = _events(runtime)
            sync = [i for i, e in enumerate(events) if e["kind"] == "sync" and e["phase"] == "active"]
            counted = any(b == 0 and a == 0 and samples for b, samples, a in observations)
            return bool(sync) and sum(e["kind"] == "step" for e in events[sync[0] :]) >= 3 and counted

        wait_until(
            active_with_steps, 420, "the joiner to become active, train 3 epochs and count its samples", poll=0.5
        )
        # The monitor confirms its points from the signed metrics it publishes in the DHT.
        wait_until(lambda: _confirmed(monitor_url, peer_id) > 0, 120, "the monitor to confirm the joiner's points")
        wait_until(
            lambda: any(e["kind"] == "points" and (e["confirmed"] or 0) > 0 for e in _events(runtime)),
            60,
            "the client to show its confirmed points",
        )
        wait_until(
            lambda: _compute_grew(_events(runtime)), 90, "compute points to grow between two estimates once active"
        )
        # samples counted in the DHT show in the step that ends their epoch: a joiner given few requests may
        # have stepped only empty epochs so far
        wait_until(lambda: _stepped_with_samples(_events(runtime)), 120, "a stage epoch with the joiner's samples")
    finally:
        runtime.stop(grace=30)
        observer.shutdown()

    events = _events(runtime)
    assert not runtime.alive
    auth = [e for e in events if e["kind"] == "auth"]
    assert auth[-1]["status"] == "authorized" and auth[-1]["stage"] == stage
    assert any(e["kind"] == "download" and e["status"] == "done" for e in events)

    # Every phase, in order, with the messages the contributor sees.
    sync = [e for e in events if e["kind"] == "sync"]
    assert [e["phase"] for e in sync] == ["sync1", "sync2", "active"]
    assert sync[0]["message"].splitlines() == [
        "Synchronising weights with peers. Node won't process batches in this phase.",
        f"This phase will last {PHASE1_STEPS} steps (until local epoch {sync[0]['target_epoch']}).",
    ]
    assert sync[1]["message"].splitlines()[0].startswith("Synchronising optimizer state.")
    assert sync[2]["message"] == "Sync complete. Node is now fully contributing to training."

    # The DHT record follows the phases in order.
    seen = [before for before, _, _ in observations]
    order = [p for i, p in enumerate(seen) if i == 0 or p != seen[i - 1]]
    assert order == [1, 2, 0], f"DHT phases seen in this order: {order}"

    # Trainers route to it only from phase 2: no request while in phase 1.
    index = {id(e): i for i, e in enumerate(events)}
    phase1_steps = [e for e in events if e["kind"] == "step" and index[id(sync[0])] < index[id(e)] < index[id(sync[1])]]
    assert phase1_steps and all(e["forward_per_min"] == 0 and e["backward_per_min"] == 0 for e in phase1_steps)
    # each step event counts the requests since the previous one: an epoch shorter than a request has none
    assert any(e["forward_per_min"] > 0 for e in events[index[id(sync[1])] :] if e["kind"] == "step")

    # Its samples count toward the stage batch only once active.
    syncing = [samples for before, samples, after in observations if before in (1, 2) and after in (1, 2)]
    assert all(not samples for samples in syncing), syncing  # (and the wait above saw samples counted once active)

    _check_counts_and_points(events, stage, preset_path)

    # SPARTA pulled it toward its peer in full while it synced (receive-only, weight 0: the rule itself is tested in
    # test_sparta). A stop writes no exit snapshot any more, so its final weights are not compared here.
    receive_only = [e for e in events if e["kind"] == "sparta" and e["weight"] == 0.0]
    assert any(e["ok"] and e["fraction"] == 1.0 and e["bytes_received"] > 0 for e in receive_only), (
        f"no complete receive-only round: {receive_only}"
    )


def test_app_on_a_real_runtime_reaches_active_and_quits_clean(join_swarm, tmp_path):
    from agora_client.frontend.supervisor import INTERRUPT_TIMEOUT_S, runtime_command
    from tui.app import AgoraApp
    from tui.state import JoinStep

    swarm, auth_url, token, preset_path, _ = join_swarm
    command = runtime_command(token=token, swarm=auth_url, cpu=True, config_dir=tmp_path / "client", host_port=0)
    app = AgoraApp(command)

    async def drive() -> list[int]:
        async with app.run_test(size=(100, 34)) as pilot:
            deadline = time.monotonic() + 300
            while app.tracker.step != JoinStep.ACTIVE:
                assert time.monotonic() < deadline, f"app stuck at {app.tracker.step.name}: {app.tracker.status}"
                assert app.tracker.failure is None, app.tracker.failure
                await pilot.pause(0.5)
            pgid = app.process.pid
            started = time.monotonic()
            await pilot.press("q")
            await pilot.pause(0.5)
            deadline = time.monotonic() + 60
            while app.is_running and time.monotonic() < deadline:
                await pilot.pause(0.5)
            stopped.append(time.monotonic() - started)
            return [p.pid for p in psutil.process_iter() if _in_group(p, pgid)]

    stopped: list[float] = []
    leftovers = asyncio.run(drive())
    assert leftovers == []
    # It left by itself on SIGINT (exit 0), well before the supervisor's SIGTERM: a graceful stop.
    assert app.process.returncode == 0 and stopped[0] < INTERRUPT_TIMEOUT_S, (app.process.returncode, stopped)
    assert app.return_code == 0


def _compute_points_once_active(events: list[dict]) -> list[float]:
    """The compute points of every estimate since the worker became active that counts any request: an estimate
    taken just as it became active may come before its first request is answered (0)."""
    active = next((i for i, e in enumerate(events) if e["kind"] == "sync" and e["phase"] == "active"), len(events))
    return [e["compute"] for e in events[active:] if e["kind"] == "points" and e["compute"] > 0]


def _compute_grew(events: list[dict]) -> bool:
    computed = _compute_points_once_active(events)
    return len(computed) >= 2 and computed[-1] > computed[0]


def _stepped_with_samples(events: list[dict]) -> bool:
    """A step since the worker became active had samples of its own: its share of the stage epoch is above 0."""
    active = next((i for i, e in enumerate(events) if e["kind"] == "sync" and e["phase"] == "active"), len(events))
    return any((e["stage_share"] or 0) > 0 for e in events[active:] if e["kind"] == "step")


def _check_counts_and_points(events: list[dict], stage: str, preset_path) -> None:
    """Requests are counted where they are answered, the head's backward ones too, and the points the
    client shows are the FLOPs of exactly those requests plus the time it was registered (issue #16)."""
    from agora_client.config import load_config
    from agora_client.monitor.flops import request_flops
    from agora_client.monitor.points import PFLOP, SECONDS_PER_HOUR

    assert stage == "head"  # the first joiner gets the first stage: the one whose backward count was 0
    active = next(i for i, e in enumerate(events) if e["kind"] == "sync" and e["phase"] == "active")
    traffic = [e for e in events if e["kind"] == "traffic"]
    # (no forward >= backward check: a backward whose forward worker is busy or gone, or a spot check, lands here alone)
    assert traffic[-1]["backward_total"] > 0 and traffic[-1]["forward_total"] > 0
    assert any(e["backward_per_min"] > 0 for e in events[active:] if e["kind"] == "traffic")
    assert any(e["backward_per_min"] > 0 for e in events[active:] if e["kind"] == "step")
    assert traffic[-1]["bytes_received"] > 0 and traffic[-1]["bytes_sent"] > 0

    config = load_config(str(preset_path))
    rows, seq = config.optim.microbatch_size, config.model.seq_len
    per_request = {kind: request_flops(config.model, stage, kind, rows, seq) for kind in ("forward", "backward")}
    points = [(i, e) for i, e in enumerate(events) if e["kind"] == "points"]
    assert _compute_grew(events), _compute_points_once_active(events)
    for (_, event), (_, following) in pairwise(points):
        # presence accrues with wall time while registered (1 point per hour)
        gained = (following["presence"] - event["presence"]) * SECONDS_PER_HOUR
        assert abs(gained - (following["ts"] - event["ts"])) < 3.0, (gained, following["ts"] - event["ts"])
    for i, event in points:
        # compute = the FLOPs of the requests counted by the meter up to then (bounded by the traffic samples around it)
        before = [e for e in events[:i] if e["kind"] == "traffic"]
        after = [e for e in events[i:] if e["kind"] == "traffic"]
        if not before or not after:
            continue
        bound = lambda t: t["forward_total"] * per_request["forward"] + t["backward_total"] * per_request["backward"]  # noqa: E731
        assert bound(before[-1]) <= event["compute"] * PFLOP * (1 + 1e-9) and event["compute"] * PFLOP <= bound(
            after[0]
        ) * (1 + 1e-9)

    swarm = [e for e in events if e["kind"] == "swarm" and e["loss"] is not None]
    assert swarm and swarm[-1]["trainers"] >= 1 and len(swarm[-1]["loss_history"]) >= 2


def _confirmed(monitor_url: str, peer_id: str) -> float:
    reply = httpx.get(f"{monitor_url}/peers/{peer_id}", timeout=5)
    return float(reply.json()["score"]) if reply.status_code == 200 else 0.0


def _in_group(process: psutil.Process, pgid: int) -> bool:
    try:
        import os

        return os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False
