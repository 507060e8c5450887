"""Pilot tests: the preflight view and the reachability diagnosis.

Driven by recorded streams replayed by a real child."""

from __future__ import annotations

import json

import pytest
from textual.content import Content

from tests.replays import FIXTURES, SIZE, line_count, make_app, until
from tui.app import AgoraApp
from tui.state import PREFLIGHT_ADVICE, JoinStep
from tui.widgets import LogPane, PreflightPanel, ReachabilityPanel, RuntimeStatus, Stepper

pytestmark = pytest.mark.timeout(120)


def plain(widget) -> str:
    """What a Static shows (or a markup string says), as plain text."""
    if isinstance(widget, str):
        return Content.from_markup(widget).plain
    content = widget.visual if hasattr(widget, "visual") else widget.render()
    return content.plain if isinstance(content, Content) else Content.from_markup(str(content)).plain


def row(app: AgoraApp, check: str) -> tuple[str, str]:
    """(status, text) of one preflight row."""
    widget = app.query_one(f"#check-{check}")
    status = next(name for name in ("pass", "warn", "fail", "checking", "waiting") if widget.has_class(f"-{name}"))
    return status, plain(widget.query_one(".check-text"))


def footer_keys(app: AgoraApp) -> set[str]:
    return {binding.binding.action for binding in app.screen.active_bindings.values() if binding.enabled}


async def test_preflight_in_progress_shows_each_check_as_it_comes_in_place_of_the_dashboard():
    app = make_app("preflight_running", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.lines_read >= line_count("preflight_running"))
        assert app.has_class("-preflight") and app.tracker.in_preflight
        assert app.query_one("#preflight-view").display and not app.query_one("#dashboard").display
        assert not app.query_one(ReachabilityPanel).display  # nothing to diagnose yet
        assert row(app, "gpu") == (
            "pass",
            "NVIDIA GeForce RTX 4090, 25.8 GB VRAM, compute capability 8.9 — GPU 0 is cuda:0",
        )
        status, text = row(app, "host_ram")
        assert status == "warn" and text.endswith("— little headroom beyond the stage itself")
        assert row(app, "disk")[0] == "pass"
        assert row(app, "download_rate") == ("checking", "checking...")
        assert row(app, "upload_rate") == ("waiting", "waiting")
        assert row(app, "seed_rtt") == ("waiting", "waiting")
        assert row(app, "reachability") == ("waiting", "tested by the swarm when this worker asks to join")
        assert plain(app.query_one(PreflightPanel).border_subtitle) == "2 passed · 1 warning"
        assert "3 of 6 checks done" in app.query_one(Stepper).status
        assert "toggle_preflight" in footer_keys(app) and "retry" not in footer_keys(app)


async def test_a_failed_check_keeps_the_preflight_on_screen_and_says_what_to_do():
    app = make_app("preflight_failed", "--exit-code", "1")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.query_one(RuntimeStatus).display)
        failure = app.query_one(Stepper).failure
        assert failure.step == JoinStep.AUTHORIZATION and failure.reason.startswith("preflight failed: disk:")
        assert failure.advice == PREFLIGHT_ADVICE  # not the token advice of a failed authorization
        status, text = row(app, "disk")
        assert status == "fail" and "1.2 GB free" in text and "free space or pass another --config-dir" in text
        assert row(app, "host_ram")[0] == "warn" and row(app, "seed_rtt")[0] == "pass"
        assert row(app, "reachability") == ("waiting", "not tested: the worker stopped before joining")
        assert plain(app.query_one(PreflightPanel).border_subtitle) == "4 passed · 1 warning · 1 failed"
        assert app.has_class("-preflight")
        assert "restart" in footer_keys(app) and "retry" not in footer_keys(app)


async def test_unreachable_shows_the_diagnosis_r_retries_and_the_dashboard_follows_the_join():
    app = make_app("unreachable", "--hold", "--on-retry", str(FIXTURES / "reachable.jsonl"))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.lines_read >= line_count("unreachable"))
        panel = app.query_one(ReachabilityPanel)
        await until(pilot, lambda: len(panel.query(".advice-row")) > 0)
        assert app.tracker.unreachable and app.has_class("-unreachable") and panel.display
        assert plain(panel.query_one("#reach-port")) == "TCP 49200 · dialed at 203.0.113.7:49200"
        assert plain(panel.query_one("#reach-from")) == "198.51.100.20 (the swarm's auth service, agora-auth-1)"
        assert plain(panel.query_one("#reach-result")).startswith("no answer (timeout)")
        advice = json.loads((FIXTURES / "unreachable.jsonl").read_text().splitlines()[-1])["advice"]
        shown = [plain(static) for static in panel.query(".advice-text")]
        assert shown == advice[1:]  # advice[0] says what the port / tested-from / result rows say
        assert any("Turn on UPnP" in line and "forward TCP port 49200 to 192.168.1.20" in line for line in shown)
        assert plain(panel.query_one("#reach-result")).endswith(
            "\nbehind NAT: 192.168.1.20 is seen as 203.0.113.7 · no router offered port mapping (UPnP or NAT-PMP)"
        )
        assert plain(panel.query_one("#reach-retry")) == (
            "Not joining while unreachable · next attempt in 30s · press r to retry now"
        )
        assert row(app, "reachability")[0] == "fail" and row(app, "download_rate")[0] == "warn"
        assert "Not reachable at 203.0.113.7:49200" in app.query_one(Stepper).status
        assert "retry" in footer_keys(app) and "restart" not in footer_keys(app)
        pid = app.process.pid
        await pilot.press("r")  # SIGUSR1: the replay plays what the runtime says after a successful retry
        await until(pilot, lambda: app.lines_read >= line_count("unreachable", "reachable"))
        assert app.process.pid == pid  # a retry, not a restart
        assert not app.tracker.unreachable and app.tracker.authorized
        assert app.query_one(Stepper).step == JoinStep.DOWNLOAD
        assert not app.has_class("-preflight") and app.query_one("#dashboard").display
        assert not app.query_one("#preflight-view").display
        assert row(app, "reachability")[0] == "pass"
        assert "[REACHABILITY] The swarm reached this worker at 203.0.113.7:49200" in "\n".join(
            app.query_one(LogPane).plain_lines()
        )
        # p brings the preflight back after the join, and hides it again
        await pilot.press("p")
        assert app.query_one("#preflight-view").display and not app.query_one("#dashboard").display
        assert not panel.display  # reachable now: no diagnosis
        await pilot.press("p")
        assert not app.query_one("#preflight-view").display and app.query_one("#dashboard").display


async def test_without_preflight_events_the_dashboard_shows_and_p_is_not_offered():
    app = make_app("authorizing", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.lines_read >= line_count("authorizing"))
        assert not app.has_class("-preflight") and app.query_one("#dashboard").display
        assert "toggle_preflight" not in footer_keys(app)


async def test_a_first_failed_dial_back_with_the_relay_untried_says_the_relay_is_tried_now():
    app = make_app("relay_next", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.lines_read >= line_count("relay_next"))
        panel = app.query_one(ReachabilityPanel)
        await until(pilot, lambda: "relay" in plain(panel.query_one("#reach-retry")))
        assert plain(panel.query_one("#reach-retry")) == "Not reachable directly: trying the run's relay now..."
        assert app.query_one(Stepper).status == "Not reachable at 203.0.113.7:49200: trying the run's relay..."


def test_the_tracker_follows_the_checks_and_the_dial_backs():
    from agora_client.events import AuthEvent, ErrorEvent, PreflightEvent, ReachabilityEvent
    from tui.state import JoinTracker

    tracker = JoinTracker()
    assert not tracker.in_preflight and tracker.preflight.checking == "gpu"
    tracker.apply(PreflightEvent(check="gpu", status="warn", value="CPU", reason="no --gpu given"))
    assert tracker.in_preflight and tracker.preflight.checking == "host_ram"
    assert tracker.status == "Preflight: checking this machine and its network (1 of 6 checks done)..."
    for check in ("host_ram", "disk", "download_rate", "upload_rate", "seed_rtt"):
        tracker.apply(PreflightEvent(check=check, status="pass", value="ok"))
    assert tracker.preflight.checking is None and tracker.status.startswith("Preflight done")
    tracker.apply(ReachabilityEvent(status="checking", port=49200))
    assert tracker.preflight.checking == "reachability" and "port 49200" in tracker.status
    # the first failed dial-back of a worker with a relay still untried goes on through it, without waiting
    tracker.apply(ReachabilityEvent(status="unreachable", address="203.0.113.7:49200", port=49200, trying_relay=True))
    assert tracker.status == "Not reachable at 203.0.113.7:49200: trying the run's relay..."
    tracker.apply(ReachabilityEvent(status="unreachable", address="203.0.113.7:49200", port=49200, retry_in_s=30))
    assert tracker.status.endswith("open the port (see below); r retries now")
    assert (
        tracker.unreachable and tracker.preflight.failed_dials == 2 and tracker.failure is None
    )  # waiting, not failed
    tracker.retry_now()
    assert tracker.preflight.retry_requested and tracker.status.startswith("Retrying now")
    tracker.apply(ReachabilityEvent(status="checking", port=49200))
    assert tracker.unreachable  # the diagnosis stays until the swarm gets through
    tracker.apply(AuthEvent(status="authorized", identity="alice", stage="body1"))
    tracker.apply(ReachabilityEvent(status="reachable", address="203.0.113.7:49200", port=49200))
    assert not tracker.unreachable and not tracker.in_preflight and tracker.step == JoinStep.DOWNLOAD
    assert tracker.status == "Authorized as alice, stage body1"  # the auth line is kept
    # a failed machine check: the advice points at the check, unless the runtime gave its own hint
    failed = JoinTracker()
    failed.apply(PreflightEvent(check="disk", status="fail", value="1 GB free", reason="not enough disk"))
    failed.apply(ErrorEvent(message="preflight failed: disk: not enough disk"))
    assert failed.failure.advice == PREFLIGHT_ADVICE
    hinted = JoinTracker()
    hinted.apply(PreflightEvent(check="disk", status="fail", value="1 GB free", reason="not enough disk"))
    hinted.apply(ErrorEvent(message="boom", hint="do this"))
    assert hinted.failure.advice == "do this"
    plain_failure = JoinTracker()
    plain_failure.apply(ErrorEvent(message="could not read the run description"))
    assert plain_failure.failure.advice != PREFLIGHT_ADVICE  # no check failed: the authorization advice
