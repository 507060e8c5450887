"""The public page's server side, without a browser: its files and their headers on a real monitor HTTP server,
the JSON it reads (the swarm summary, one contributor with an escaped name), the bounded points history, the token
tally, and the contributor URLs that `agora leaderboard` prints."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import time
import tomllib
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from agora_client.discovery.signed_records import MetricsRecord
from agora_client.monitor import leaderboard_cli
from agora_client.monitor.history import HISTORY_BUCKET_S, HISTORY_SPAN_S
from agora_client.monitor.http_api import LeaderboardServer
from agora_client.monitor.points import Observation
from agora_client.monitor.store import PointsStore
from agora_client.monitor.swarm_summary import TokenTally
from tests.recorded_swarm import HOSTILE_NAME, POLICY, STAGES, TICKET, WITHHELD_REASON, record_swarm

REPO = Path(__file__).resolve().parents[1]
STATIC = REPO / "agora_client" / "monitor" / "page" / "static"


@pytest.fixture
def monitor(tmp_path):
    store, run = record_swarm(tmp_path / "points.sqlite", now=time.time())
    server = LeaderboardServer(store, run=run).start()
    yield server
    server.stop()
    store.close()


def test_page_is_served_with_a_strict_content_security_policy(monitor):
    for path, kind in (
        ("/", "text/html"),
        ("/contributors/alice", "text/html"),
        ("/static/common.js", "text/javascript"),
        ("/static/page.css", "text/css"),
        ("/static/favicon.svg", "image/svg+xml"),
    ):
        reply = httpx.get(f"{monitor.url}{path}", timeout=5)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(kind), path
        policy = reply.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src 'self';" in policy and "unsafe" not in policy
        assert reply.headers["x-content-type-options"] == "nosniff"
    for path in ("/static/../store.py", "/static/missing.js", "/contributors/nobody"):
        assert httpx.get(f"{monitor.url}{path}", timeout=5).status_code == 404, path


def test_page_files_load_nothing_from_elsewhere_and_hold_no_inline_script():
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text.replace("http://www.w3.org/2000/svg", "")), (
            path
        )
        if path.suffix == ".html":
            assert re.findall(r"<script[^>]*>", text) == re.findall(r'<script src="/static/[a-z]+\.js" defer>', text)
            assert not re.search(r"<style|<[^>]+\s(style|on[a-z]+)=", text), path  # inline styles and handlers


def test_page_files_are_package_data():
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["agora_client"]
    for path in STATIC.iterdir():
        relative = str(path.relative_to(REPO / "agora_client"))
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in globs), (
            f"{relative} would be left out of the wheel"
        )


def test_page_swarm_view_gives_run_stages_and_tokens(monitor):
    swarm = httpx.get(f"{monitor.url}/swarm", timeout=5).json()
    assert swarm["run"]["name"] == "tiny" and "4 stages" in swarm["run"]["model"]
    assert (swarm["contributors"], swarm["online"]) == (5, 5)
    summary = swarm["summary"]
    assert summary["tokens_per_s"] == 5123.0
    assert summary["tokens_seen"] == 2 * 50_000  # two head workers, 5 scrapes' worth of 10,000 tokens each
    stages = {stage["stage"]: stage for stage in summary["stages"]}
    assert list(stages) == list(STAGES)
    assert (stages["tail"]["active"], stages["tail"]["syncing"], stages["tail"]["queued"]) == (1, 1, 3)
    assert stages["body1"]["sparta_success"] == 0.75
    assert stages["tail"]["spot_checks"] == {
        "checks": 20,
        "strikes": 4,
        "bans": 0,
        "forward": "verifiable",
        "backward": "calibrating",
    }
    assert TICKET not in json.dumps(swarm)


def test_page_contributor_view_takes_an_escaped_name_and_says_why_points_are_withheld(monitor):
    hostile = httpx.get(f"{monitor.url}/identities/{quote(HOSTILE_NAME, safe='')}", timeout=5)
    assert hostile.status_code == 200 and hostile.json()["identity"] == HOSTILE_NAME
    assert httpx.get(f"{monitor.url}/contributors/{quote(HOSTILE_NAME, safe='')}", timeout=5).status_code == 200
    carol = httpx.get(f"{monitor.url}/identities/carol", timeout=5).json()
    assert carol["withheld_compute"] == pytest.approx(2.5)
    assert [peer["withheld_reason"] for peer in carol["peers"]] == [WITHHELD_REASON]
    bob = httpx.get(f"{monitor.url}/identities/bob", timeout=5).json()
    assert bob["peers"][0]["flagged"] and bob["peers"][0]["unreceipted_compute"] == pytest.approx(1.25)
    assert [round(point[2], 3) for point in bob["history"]] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert TICKET not in hostile.text + json.dumps(carol) + json.dumps(bob)
    missing = httpx.get(f"{monitor.url}/identities/nobody", timeout=5)
    assert missing.status_code == 404 and "nobody" in missing.json()["error"]


def observe(store: PointsStore, ts: float, active: float) -> None:
    store.record_scrape([Observation("QmP", "alice", "head", "r1", "active", active, 0.0, ts, ts, "active")], {}, ts)


def test_page_history_keeps_one_point_per_bucket_and_a_bounded_span(tmp_path):
    store = PointsStore(tmp_path / "points.sqlite", POLICY)
    start = 1_000 * HISTORY_BUCKET_S
    for scrape in range(6):  # six scrapes in one bucket: one point, the newest figures
        observe(store, start + scrape * 10, scrape * 10)
    assert [(point.ts, round(point.presence * 3600)) for point in store.history("alice")] == [(start + 50, 50)]
    later = start + HISTORY_SPAN_S + 3 * HISTORY_BUCKET_S  # the first bucket is now older than the span kept
    observe(store, later, 60)
    assert [point.ts for point in store.history("alice")] == [later]
    store.close()


def metrics(run_id: str, tokens: int) -> MetricsRecord:
    return MetricsRecord(
        peer_id="QmP",
        identity="alice",
        ticket="t",
        stage="head",
        run_id=run_id,
        sync_phase="active",
        flops_total=0,
        compute_flops=0,
        active_seconds=0,
        busy_seconds=0,
        batches=0,
        forwards=0,
        tokens=tokens,
        ts=0,
    )


def test_page_token_tally_keeps_what_a_restarted_worker_had_counted():
    tally = TokenTally()
    assert tally.update([metrics("r1", 100)]) == 100
    assert tally.update([metrics("r1", 250)]) == 250
    assert tally.update([metrics("r2", 10)]) == 260  # a new run: its counter restarts, the old one's 250 stay
    assert tally.update([]) == 260


def leaderboard(capsys, *arguments: str) -> str:
    parser = argparse.ArgumentParser()
    leaderboard_cli.configure(parser)
    assert leaderboard_cli.run(parser.parse_args(arguments)) == 0
    return capsys.readouterr().out


def test_page_leaderboard_cli_prints_each_contributors_page(monitor, capsys):
    printed = leaderboard(capsys, "--url", f"{monitor.url}/leaderboard")
    assert f"The swarm's page: {monitor.url}/\n" in printed
    assert (
        f"Each contributor's page: {monitor.url}/contributors/<user>, e.g. {monitor.url}/contributors/alice" in printed
    )
    urls = {row["username"]: row["url"] for row in json.loads(leaderboard(capsys, "--url", monitor.url, "--json"))}
    assert urls[HOSTILE_NAME] == f"{monitor.url}/contributors/%3Cscript%3Ealert%281%29%3C%2Fscript%3E"
    assert httpx.get(urls[HOSTILE_NAME], timeout=5).status_code == 200
