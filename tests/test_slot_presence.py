"""Presence needs a slot: the auth service lists its slot holders in /v1/status, and the monitor credits presence
only to a peer among its stage's holders, whatever its records and its roster entry say (test_gaming_* in
test_points.py: what the records say)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agora_client.auth import AdmissionPolicy, AuthServer, AuthService, ServiceSettings, TokenFileIdentity
from agora_client.auth.client import authorize
from agora_client.auth.identity import write_demo_token_file
from agora_client.auth.tickets import TicketClaims
from agora_client.discovery.roster import WorkerRecord
from agora_client.discovery.signed_records import MetricsRecord
from agora_client.events import EventWriter
from agora_client.monitor.auth_view import fetch_auth_view
from agora_client.monitor.points import PointsPolicy, apply_observations
from agora_client.monitor.records import VerifiedRecord
from agora_client.monitor.scraper import observation_of

STAGES = ("head", "body1", "tail")


def verified(peer_id: str, stage: str, ts: float) -> VerifiedRecord:
    record = MetricsRecord(
        peer_id=peer_id,
        identity="alice",
        ticket="checked by monitor/records.py",
        stage=stage,
        run_id="r1",
        sync_phase="active",
        flops_total=0.0,
        compute_flops=0.0,
        active_seconds=ts,
        busy_seconds=0.0,
        batches=0,
        forwards=0,
        tokens=0,
        ts=ts,
    )
    claims = TicketClaims("alice", peer_id, stage, 0, issued_at=0.0, expires_at=1e12)
    return VerifiedRecord(record=record, claims=claims, expiration_time=1e12)


def test_the_monitor_credits_presence_only_to_the_auth_services_slot_holders(tmp_path: Path):
    token = write_demo_token_file(tmp_path / "tokens.json", "alice")
    policy = AdmissionPolicy(stages=STAGES, pacing_s=0.0, max_pending_per_stage=100)
    service = AuthService(ServiceSettings(policy=policy), TokenFileIdentity(tmp_path / "tokens.json"), tmp_path / "s")
    with AuthServer(service) as server:
        granted = authorize(server.url, token, "QmHolder", events=EventWriter())
        view = fetch_auth_view(server.url)
    assert view is not None and view.holders is not None
    assert view.holders[granted.stage] == {"QmHolder"}
    assert all(not view.holders[stage] for stage in STAGES if stage != granted.stage)

    # Both announce themselves active in the stage's roster and publish fresh records every 10 s for ten minutes;
    # only the slot holder earns presence.
    roster = {
        peer: WorkerRecord(uid=f"{granted.stage}.0.{index}", peer_id=peer, stage=granted.stage)
        for index, peer in enumerate(("QmHolder", "QmSquatter"))
    }
    peers: dict = {}
    for t in range(0, 601, 10):
        observations = [
            observation_of(verified(peer, granted.stage, t), t, roster, view.holders[granted.stage]) for peer in roster
        ]
        peers.update(apply_observations(peers, observations, t, PointsPolicy()))
    assert peers["QmHolder"].presence_seconds == pytest.approx(600)
    assert peers["QmSquatter"].presence_seconds == 0
    # A monitor that does not know the auth service goes by the roster alone.
    assert observation_of(verified("QmSquatter", granted.stage, 0), 0, roster).holds_slot


def test_an_auth_service_that_cannot_be_read_gives_no_view():
    assert fetch_auth_view("http://127.0.0.1:1") is None
