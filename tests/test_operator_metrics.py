"""Metrics for operators: every role's /metrics answers over real HTTP with the series it names, and their values
are the role's real state; the Grafana dashboard charts only series a role exports."""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora_client.auth import (
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    write_demo_token_file,
)
from agora_client.auth import operator_metrics as auth_metrics
from agora_client.averaging.sparta import RoundReport
from agora_client.discovery import operator_metrics as seed_metrics
from agora_client.discovery.dht import connect_dht
from agora_client.discovery.roster import WorkerRecord
from agora_client.monitor import operator_metrics as monitor_metrics
from agora_client.monitor.http_api import LeaderboardServer
from agora_client.monitor.points import Observation, PointsPolicy
from agora_client.monitor.store import PointsStore
from agora_client.monitor.swarm_summary import StageSummary, SwarmSummary
from agora_client.operator_metrics import MetricsEndpoint, MetricsUnavailable, Series, add_metrics_arguments
from agora_client.operator_metrics.http_front import OPEN_CONNECTIONS
from agora_client.relay import PeerCredentials, RelayReservation, RelayServer, RelaySettings, RelayUnavailable
from agora_client.relay import operator_metrics as relay_metrics
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.traffic import RequestMeter
from agora_client.snapshots import serve_directory
from agora_client.snapshots.server import BYTES_SENT
from agora_client.trainer import operator_metrics as trainer_metrics
from agora_client.trainer.balancer import Router
from agora_client.worker import operator_metrics as worker_metrics
from agora_client.worker.operator_metrics import WorkerCollector

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "agora-dashboard.json"
EXPORTED: tuple[Series, ...] = (
    *auth_metrics.SERIES,
    *monitor_metrics.SERIES,
    *worker_metrics.SERIES,
    *trainer_metrics.SERIES,
    *seed_metrics.SERIES,
    *relay_metrics.SERIES,
    BYTES_SENT,
    OPEN_CONNECTIONS,
)


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> {sorted labels: value}, parsed from what ``url`` answers (Prometheus text format)."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def scrape_until(url: str, name: str, expected: float, **labels: str) -> dict:
    """A scrape where ``name`` has reached ``expected``.

    A count a handler thread adds just after its client is done."""
    deadline = time.monotonic() + 10
    while value(samples := scrape(url), name, **labels) != expected:
        assert time.monotonic() < deadline, f"{name} stayed at {value(samples, name, **labels)}, not {expected}"
        time.sleep(0.05)
    return samples


# -- the HTTP services: /metrics on their own front ------------------------------------------------------------------


def test_the_auth_service_counts_joins_and_reports_queues_and_slots_as_its_status_does(tmp_path: Path):
    token_file = tmp_path / "tokens.json"
    tokens = {name: write_demo_token_file(token_file, name) for name in ("alice", "bob", "carol")}
    # one admission per stage per hour: the third joiner waits in the head's queue
    policy = AdmissionPolicy(stages=("head", "tail"), max_workers_per_stage=4, pacing_s=3600.0, max_pending_per_stage=1)
    service = AuthService(ServiceSettings(policy=policy), TokenFileIdentity(token_file), tmp_path / "state")
    with AuthServer(service) as server:
        answers = [
            httpx.post(f"{server.url}/v1/join", json={"token": tokens[name], "peer_id": f"Qm{name}"}).json()["status"]
            for name in ("alice", "bob", "carol")
        ]
        assert httpx.post(f"{server.url}/v1/join", json={"token": "wrong", "peer_id": "QmEve"}).status_code == 401
        assert answers == ["authorized", "authorized", "queued"]
        status = httpx.get(f"{server.url}/v1/status").json()
        samples = scrape(f"{server.url}/metrics")
    joins = samples["agora_auth_joins_total"]
    assert joins == {(("outcome", "authorized"),): 2, (("outcome", "queued"),): 1, (("outcome", "invalid_token"),): 1}
    for stage, figures in status["stages"].items():
        assert value(samples, "agora_auth_queue_length", stage=stage) == figures["queued"]
        assert value(samples, "agora_auth_slots", stage=stage, state="pending") == figures["pending"] == 1
        assert value(samples, "agora_auth_slots", stage=stage, state="active") == figures["active"] == 0
        assert value(samples, "agora_auth_slot_capacity", stage=stage) == figures["capacity"] == 4
    assert value(samples, "agora_auth_queue_length", stage="head") == status["queue_length"] == 1
    assert value(samples, "agora_auth_trainer_tickets_total", outcome="issued") == 0
    assert value(samples, "agora_http_open_connections", service="auth-http") >= 1  # the scrape's own connection
    assert "process_resident_memory_bytes" in samples


def test_the_monitor_reports_points_contributors_and_the_swarm_as_its_leaderboard_does(tmp_path: Path):
    store = PointsStore(tmp_path / "points.sqlite", PointsPolicy(online_window_s=900.0))
    now = time.time()

    def seen(peer: str, identity: str, at: float, active: float) -> Observation:
        return Observation(
            peer_id=peer,
            identity=identity,
            stage="head",
            run_id="r1",
            sync_phase="active",
            active_seconds=active,
            compute_flops=0.0,
            seen_at=at,
            published_at=at,
            swarm_phase="active",
        )

    # Presence is the time the monitor saw each peer live: p1 for the hour, p2 for its first half.
    for ago in (3600, 2700, 1800, 900, 0):
        at = now - ago
        live = [seen("p1", "alice", at, 3600 - ago)] + ([seen("p2", "bob", at, 3600 - ago)] if ago >= 1800 else [])
        store.record_scrape(live, {}, at)
    server = LeaderboardServer(store).start()
    try:
        samples = scrape(f"{server.url}/metrics")
        assert "agora_monitor_stage_workers" not in samples  # no swarm summary before the monitor's first scrape
        store.set_summary(
            SwarmSummary(
                updated_at=now,
                tokens_per_s=512.0,
                tokens_seen=10_000,
                stages=(
                    StageSummary(
                        "head", active=2, syncing=1, queued=3, sparta_rounds=7, sparta_success=1.0, spot_checks=None
                    ),
                ),
            )
        )
        with_summary = scrape(f"{server.url}/metrics")
        rows = httpx.get(f"{server.url}/leaderboard").json()["rows"]
        peers = [httpx.get(f"{server.url}/peers/{peer}").json() for peer in ("p1", "p2")]
    finally:
        server.stop()
        store.close()
    assert value(samples, "agora_monitor_contributors") == len(rows) == 2
    assert value(samples, "agora_monitor_contributors_online") == sum(row["online"] for row in rows) == 1
    for row in rows:
        assert value(samples, "agora_monitor_contributor_points", contributor=row["username"]) == pytest.approx(
            row["score"]
        )
    assert value(samples, "agora_monitor_points", kind="presence") == pytest.approx(
        sum(peer["presence"] for peer in peers)
    )
    assert value(samples, "agora_monitor_points", kind="presence") == pytest.approx(1.5, rel=1e-3)
    assert value(samples, "agora_monitor_points", kind="compute") == 0
    assert value(with_summary, "agora_monitor_stage_workers", stage="head", state="queued") == 3
    assert value(with_summary, "agora_monitor_stage_workers", stage="head", state="active") == 2
    assert value(with_summary, "agora_monitor_stage_sparta_rounds", stage="head") == 7
    assert value(with_summary, "agora_monitor_tokens_per_second") == 512.0


def test_the_snapshot_server_counts_the_bytes_it_sent(tmp_path: Path):
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "weights.bin").write_bytes(b"x" * 5000)
    with serve_directory(tmp_path) as server:
        assert len(httpx.get(f"{server.url}/head/weights.bin", headers={"Range": "bytes=1000-"}).content) == 4000
        samples = scrape_until(f"{server.url}/metrics", "agora_snapshot_bytes_sent_total", 4000)
    assert value(samples, "agora_http_open_connections", service="snapshot-http") >= 1


# -- the roles without an HTTP server: --metrics-port ------------------------------------------------------------


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    with MetricsEndpoint("127.0.0.1", 0) as served:
        yield served


def test_a_worker_serves_its_requests_refusals_rounds_drift_and_phase(endpoint: MetricsEndpoint):
    meter, refusals = RequestMeter(), RejectionLog(lambda message: None)
    record = WorkerRecord(uid="body1.0.0", peer_id="QmWorker", stage="body1", sync_phase=2, epoch=41, healthy=True)
    collector = WorkerCollector("body1", meter, refusals, lambda: record)
    endpoint.add(collector)
    refusals.start()
    try:
        for kind, received, sent in (("forward", 100, 80), ("forward", 100, 80), ("backward", 180, 100)):
            meter.on_request(kind, received, sent)
        meter.on_transfer(sent=1000, received=2000)  # a SPARTA round's messages
        refusals.report("QmStranger", "ticket", "no ticket")
        refusals.report("QmStranger", "ticket", "no ticket")
        refusals.report("QmOther", "values", "NaN in the input")
        deadline = time.monotonic() + 10
        while sum(refusals.totals().values()) < 3:  # the handlers' reports reach the main process's thread
            assert time.monotonic() < deadline, "the rejection log never counted the refusals"
            time.sleep(0.02)
    finally:
        refusals.shutdown()
    assert "agora_worker_sparta_drift" not in scrape(endpoint.url)  # no round has averaged yet
    # two rounds that averaged, then one that failed: the drift is the latest measured round's
    for ok, drift in ((True, (0.05, 0.01)), (True, (0.03, 0.002)), (False, (None, None))):
        collector.on_round(
            RoundReport(
                round=1,
                partition=0,
                group_size=2 if ok else 0,
                fraction=1.0 if ok else 0.0,
                bytes_sent=0,
                bytes_received=0,
                duration_s=1.0,
                weight=1.0,
                ok=ok,
                drift_before=drift[0],
                drift_after=drift[1],
            )
        )
    samples = scrape(endpoint.url)
    assert value(samples, "agora_worker_rpc_requests_total", stage="body1", kind="forward") == 2
    assert value(samples, "agora_worker_rpc_requests_total", stage="body1", kind="backward") == 1
    assert value(samples, "agora_worker_rpc_refused_total", stage="body1", reason="ticket") == 2
    assert value(samples, "agora_worker_rpc_refused_total", stage="body1", reason="values") == 1
    assert value(samples, "agora_worker_bytes_total", stage="body1", direction="sent") == 80 + 80 + 100 + 1000
    assert value(samples, "agora_worker_bytes_total", stage="body1", direction="received") == 100 + 100 + 180 + 2000
    assert value(samples, "agora_worker_sparta_rounds_total", stage="body1", outcome="averaged") == 2
    assert value(samples, "agora_worker_sparta_rounds_total", stage="body1", outcome="failed") == 1
    assert samples["agora_worker_sparta_drift"] == {
        (("stage", "body1"), ("when", "before")): 0.03,
        (("stage", "body1"), ("when", "after")): 0.002,
    }
    assert samples["agora_worker_sync_phase"] == {
        (("phase", "sync1"), ("stage", "body1")): 0,
        (("phase", "sync2"), ("stage", "body1")): 1,
        (("phase", "active"), ("stage", "body1")): 0,
    }
    assert value(samples, "agora_worker_epoch", stage="body1") == 41
    assert value(samples, "agora_worker_healthy", stage="body1") == 1


def test_a_trainer_serves_microbatches_requests_and_errors_per_stage(endpoint: MetricsEndpoint):
    router = Router(["head", "tail"])
    router.update_roster(
        [
            WorkerRecord(uid=f"{stage}.0.{index}", peer_id=f"Qm{stage}{index}", stage=stage)
            for stage in ("head", "tail")
            for index in (0, 1)
        ]
    )
    for _ in range(3):
        router["head"].report_success(router["head"].choose("forward"))
    router["tail"].report_failure(router["tail"].choose("forward"), TimeoutError("the worker took too long"))
    router["tail"].report_failure(router["tail"].choose("backward"), ValueError("shape mismatch"))  # not worth a retry
    endpoint.add(trainer_metrics.trainer_collector(router, lambda: 3, None))
    samples = scrape(endpoint.url)
    assert value(samples, "agora_trainer_microbatches_total") == 3
    assert value(samples, "agora_trainer_rpc_requests_total", stage="head") == 3
    assert value(samples, "agora_trainer_rpc_requests_total", stage="tail") == 0
    assert value(samples, "agora_trainer_rpc_errors_total", stage="tail", outcome="retried") == 1
    assert value(samples, "agora_trainer_rpc_errors_total", stage="tail", outcome="rejected") == 1
    assert value(samples, "agora_trainer_workers", stage="head", state="ready") == 2
    assert value(samples, "agora_trainer_requests_in_flight", stage="head") == 0
    assert "agora_trainer_spot_checks_total" not in samples  # spot checks off


def test_a_relay_serves_the_reservations_it_holds_and_its_refusals(endpoint: MetricsEndpoint):
    from hivemind.utils.crypto import RSAPrivateKey

    from agora_client.auth.relay_pass import issue_relay_pass
    from agora_client.auth.tickets import generate_signing_key, public_key_text

    low, auth_key, peer_key = random.randrange(40000, 59000), generate_signing_key(), RSAPrivateKey()
    settings = RelaySettings(
        host="127.0.0.1",
        public_host="127.0.0.1",
        port_lo=low,  # ports in use are skipped by the relay
        port_hi=low + 30,
        max_reservations=5,
        auth_public_key=public_key_text(auth_key),
    )
    relay_pass = issue_relay_pass(auth_key, identity="alice", peer_id=PeerCredentials(peer_key, str).peer_id)
    with RelayServer(settings) as relay:
        endpoint.add(relay_metrics.relay_collector(relay))
        assert value(scrape(endpoint.url), "agora_relay_reservations") == 0
        with pytest.raises(RelayUnavailable, match="no relay pass"):
            RelayReservation(f"127.0.0.1:{relay.port}", 9, on_lost=print, credentials=None).open()
        credentials = PeerCredentials(peer_key, lambda: relay_pass)
        with RelayReservation(f"127.0.0.1:{relay.port}", 9, on_lost=print, credentials=credentials) as reservation:
            reservation.open()
            samples = scrape(endpoint.url)
    assert value(samples, "agora_relay_reservations") == 1
    assert value(samples, "agora_relay_reservation_capacity") == 5
    assert value(samples, "agora_relay_refusals_total", reason="no_pass") == 1


def test_a_seed_serves_the_peers_in_its_routing_table(endpoint: MetricsEndpoint):
    seed = connect_dht([])
    try:
        endpoint.add(seed_metrics.seed_collector(seed))
        assert value(scrape(endpoint.url), "agora_seed_dht_peers") == 0
        peer = connect_dht([str(address) for address in seed.get_visible_maddrs()])
        try:
            scrape_until(endpoint.url, "agora_seed_dht_peers", 1)
        finally:
            peer.shutdown()
    finally:
        seed.shutdown()


def test_metrics_port_is_off_by_default_and_a_taken_port_says_what_to_do():
    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser)
    assert MetricsEndpoint(**_endpoint_arguments(parser.parse_args([]))).url is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            MetricsUnavailable, match=f"cannot serve metrics on 127.0.0.1:{port}.*pick another --metrics-port"
        ):
            MetricsEndpoint(**_endpoint_arguments(parser.parse_args(["--metrics-port", str(port)])))


def _endpoint_arguments(args: argparse.Namespace) -> dict:
    return {"host": args.metrics_host, "port": args.metrics_port}


@pytest.mark.parametrize(
    "module, required",
    [
        ("agora_client.discovery.seed", []),
        ("agora_client.worker.main", ["--stage", "head", "--seeds", "/ip4/127.0.0.1/tcp/1"]),
        ("agora_client.trainer.main", ["--seeds", "/ip4/127.0.0.1/tcp/1"]),
        (
            "agora_client.relay.main",
            ["--public-host", "relay.example", "--ports", "50000-50010", "--auth-public-key", "K"],
        ),
    ],
)
def test_every_role_without_an_http_server_takes_a_metrics_port(module: str, required: list[str]):
    parser = argparse.ArgumentParser()
    __import__(module, fromlist=["configure"]).configure(parser)
    args = parser.parse_args([*required, "--metrics-port", "9101", "--metrics-host", "0.0.0.0"])
    assert (args.metrics_port, args.metrics_host) == (9101, "0.0.0.0")


# -- the Grafana dashboard ---------------------------------------------------------------------------------------

_PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "topk", "by", "without", "rate", "increase", "deriv"}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "agora-swarm"
    assert any(
        variable["name"] == "DS_PROMETHEUS" and variable["type"] == "datasource"
        for variable in dashboard["templating"]["list"]
    )
    queries = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        queries += [target["expr"] for target in panel["targets"]]
    return queries


def test_the_dashboard_charts_only_series_the_roles_export_by_their_labels():
    exported = {series.exposed_name: series for series in EXPORTED}
    charted = set()
    for query in dashboard_queries():
        names = set(re.findall(r"\bagora_\w+", query))
        assert names, f"{query!r} charts no agora series"
        unknown = names - set(exported)
        assert not unknown, f"{query!r} names series no role exports: {sorted(unknown)}"
        labels = {label for name in names for label in exported[name].labels} | {"instance", "job"}
        grouped = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", query) for label in group.split(",")}
        assert grouped <= labels, f"{query!r} groups by labels its series lack: {sorted(grouped - labels)}"
        words = set(re.findall(r"\b([a-z_]+)\s*\(", query)) - _PROMQL_WORDS
        assert not words, f"{query!r} uses functions this test does not know: {sorted(words)}"
        charted |= names
    for role in ("auth", "worker", "trainer", "monitor", "seed", "relay", "snapshot", "http"):
        assert any(name.startswith(f"agora_{role}_") for name in charted), f"no panel charts the {role}'s series"
