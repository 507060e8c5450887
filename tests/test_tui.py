"""Pilot tests: the app driven by recorded event streams replayed by a real child process."""

from __future__ import annotations

import json
import zipfile

import psutil
import pytest
from textual.app import App
from textual.content import Content

from agora_client.events import ExitEvent, PointsEvent, dump_event
from tests.replays import FIXTURES, SIZE, T0, line_count, make_app, until
from tui.app import AgoraApp, BundleTarget
from tui.state import JoinStep
from tui.widgets import (
    GpuPanel,
    IdentityPanel,
    JoinPanel,
    LogPane,
    LossPanel,
    NetworkPanel,
    PointsPanel,
    RuntimeStatus,
    SpartaPanel,
    Stepper,
    TrainingPanel,
)

pytestmark = pytest.mark.timeout(120)


async def replayed(pilot, app: AgoraApp, name: str) -> None:
    await until(pilot, lambda: app.lines_read >= line_count(name))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def shown(widget) -> str:
    """The plain text a widget shows (render() may return markup)."""
    rendered = widget.render()
    return Content.from_markup(rendered).plain if isinstance(rendered, str) else str(rendered)


def log_text(app: AgoraApp) -> str:
    return "\n".join(app.query_one(LogPane).plain_lines())


async def test_every_panel_follows_an_active_stream_and_q_stops_the_child():
    app = make_app("active", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "active")
        stepper = app.query_one(Stepper)
        assert stepper.step == JoinStep.ACTIVE and stepper.failure is None
        identity = app.query_one(IdentityPanel)
        assert (identity.identity, identity.slot, identity.stage) == ("alice", 7, "body1")
        assert identity.occupancy["body1"] == 4
        assert app.query_one(JoinPanel).current == "sync"
        assert app.query_one(TrainingPanel).step.local_epoch == 78
        assert app.query_one(PointsPanel).points.confirmed == 224.0
        assert app.query_one(GpuPanel).resources.gpu.name == "NVIDIA GeForce RTX 4090"
        sparta = shown(app.query_one("#sparta .detail"))
        assert "round 18" in sparta and "15/18 rounds ok (83%)" in sparta
        groups = [size for _, size in app.query_one(SpartaPanel).chart.series["group"]]
        assert len(groups) == 18 and groups.count(0) == 3  # three failed rounds drop to 0
        # the swarm's loss over time, from the trainers' records
        swarm_events = [
            json.loads(line)
            for line in (FIXTURES / "active.jsonl").read_text().splitlines()
            if '"kind":"swarm"' in line
        ]
        last_swarm = swarm_events[-1]
        loss_chart = app.query_one(LossPanel).chart
        assert list(loss_chart.series["loss"]) == [tuple(point) for point in last_swarm["loss_history"]]
        assert loss_chart.display and loss_chart.series["loss"][-1][1] < loss_chart.series["loss"][0][1]
        swarm_detail = shown(app.query_one("#loss .detail"))
        # the held-out eval loss beside it, with its trend over the evaluations
        assert f"loss {last_swarm['loss']:.3f} · ━ eval {last_swarm['eval_loss']:.3f}" in swarm_detail
        assert "↓ 0.484 over 3 evals · 2 trainer(s)" in swarm_detail
        # requests per minute and bandwidth, one chart point per traffic sample
        traffic = [line for line in (FIXTURES / "active.jsonl").read_text().splitlines() if '"kind":"traffic"' in line]
        assert len(app.query_one(TrainingPanel).chart.series["backward"]) == len(traffic)
        assert len(app.query_one(NetworkPanel).chart.series["up"]) == len(traffic)
        assert "↑" in shown(app.query_one("#network .detail")) and "/min" in shown(app.query_one("#training .detail"))
        # share of the stage, points with rank
        assert "of body1's samples (last 10 epochs)" in shown(app.query_one("#share .detail"))
        points = shown(app.query_one("#points .detail"))
        assert "rank #3 of 12" in points and "confirmed 224" in points
        assert "compute 211 verified of 222 claimed" in points and "exceeds" not in points
        text = log_text(app)
        assert "[SYNC] Sync complete. Node is now fully contributing to training." in text
        assert "[SPARTA] Round 11 failed" in text
        pid = app.process.pid
        assert not gone(pid)
        await pilot.press("q")
        # the exit code, not the child's end: the child is gone a moment before the app's stop worker calls exit()
        await until(pilot, lambda: not app.is_running or app.return_code is not None)
    assert gone(pid)
    assert app.return_code == 0


async def test_the_points_panel_says_when_the_claim_exceeds_the_trainers_receipts():
    class PointsOnly(App):
        def compose(self):
            yield PointsPanel()

    app = PointsOnly()
    async with app.run_test(size=(40, 15)) as pilot:
        panel = app.query_one(PointsPanel)
        panel.show(
            PointsEvent(
                presence=1.0, compute=40.0, confirmed=5.0, claimed_compute=40.0, verified_compute=4.0, flagged=True
            )
        )
        await pilot.pause()
        assert "compute 4.00 verified of 40.00 claimed: the claim exceeds the trainers' receipts" in shown(
            panel.query_one(".detail")
        )
        panel.show(PointsEvent(presence=1.0, compute=4.0))  # no word from a monitor: no verified line
        await pilot.pause()
        assert "verified" not in shown(panel.query_one(".detail"))


async def test_download_shows_progress_rate_eta_and_resume_then_queue_position():
    app = make_app("downloading", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "downloading")
        assert app.query_one(Stepper).step == JoinStep.DOWNLOAD
        download = app.query_one("#download")
        assert (download.done_bytes, download.total_bytes) == (222_000_000, 480_000_000)
        detail = shown(app.query_one("#download-detail"))
        assert "24.0 MB/s" in detail and "ETA 11s" in detail and "resumed from 150.0 MB" in detail
        assert "[WARNING] Download of body1/state.safetensors interrupted (connection reset by peer)" in log_text(app)
    app = make_app("queued", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "queued")
        assert app.query_one(Stepper).step == JoinStep.QUEUE
        assert app.query_one(JoinPanel).current == "queue"
        queue = app.query_one("#queue")
        assert (queue.position, queue.wait_s) == (2, 120)


async def test_sync_phases_show_steps_and_target_epoch():
    app = make_app("sync1", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "sync1")
        assert app.query_one(Stepper).step == JoinStep.SYNC1
        rendered = shown(app.query_one("#sync"))
        assert "step 14 of 40" in rendered and "target local epoch 52" in rendered


async def test_no_gpu_shows_the_note_with_worker_and_host_memory():
    app = make_app("no_gpu", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "no_gpu")
        rendered = shown(app.query_one(GpuPanel))
        assert "no NVIDIA driver: showing worker and host memory" in rendered
        assert "worker 2.3 GB" in rendered and "host RAM 6.2 GB / 17.2 GB" in rendered


async def test_crashed_child_shows_its_reason_and_restart_brings_it_back():
    app = make_app("crash", "--exit-code", "1", "--stderr", "RuntimeError: CUDA out of memory")
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one(RuntimeStatus)
        await until(pilot, lambda: status.display and app.stderr_tail)
        failure = app.query_one(Stepper).failure
        assert failure.step == JoinStep.SYNC2
        assert "CUDA out of memory while running backward" in failure.reason
        assert "pick another one with --reconfigure" in failure.advice
        assert "exited with code 1" in shown(app.query_one("#runtime-status-detail"))
        assert app.check_action("restart", ()) is True
        first_pid = app.process.pid
        await pilot.press("r")
        await until(pilot, lambda: app.process.pid != first_pid and app.lines_read >= 5)
        assert not status.display or app.process.returncode is not None
        assert app.query_one(Stepper).step >= JoinStep.AUTHORIZATION
        await until(pilot, lambda: status.display)  # the replay crashes again, and says so again
        assert gone(first_pid)


async def test_q_stops_the_child_and_everything_in_its_group():
    app = make_app("active", "--hold", "--spawn-grandchild")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "active")
        child = psutil.Process(app.process.pid)
        await until(pilot, lambda: child.children())
        grandchild = child.children()[0].pid
        await pilot.press("q")
        await until(pilot, lambda: gone(child.pid) and gone(grandchild))
    assert gone(child.pid) and gone(grandchild)


async def test_a_child_ignoring_sigint_is_terminated_within_the_bound():
    app = make_app("sync1", "--hold", "--ignore-sigint", interrupt_timeout_s=0.5, terminate_timeout_s=2.0)
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "sync1")
        pid = app.process.pid
        await pilot.press("ctrl+c")
        await until(pilot, lambda: gone(pid), timeout=10)
    assert app.process.returncode is not None and app.process.returncode < 0  # ended by a signal
    assert app.return_code == 130  # Ctrl-C: interrupted, as in headless mode


async def test_quitting_after_a_rejection_exits_3():
    app = make_app("rejected", "--exit-code", "3")
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.query_one(RuntimeStatus).display)
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 3


async def test_malformed_lines_are_warnings_not_crashes():
    app = make_app("malformed", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "malformed")
        text = log_text(app)
        assert text.count("Ignored a malformed line from the runtime") == 4
        assert "event version 2 is not 1" in text
        assert app.query_one("#queue").position == 4  # valid events after the bad ones still count
        assert app.process.running


async def test_log_pane_filters_by_level_and_tag():
    app = make_app("active", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "active")
        pane = app.query_one(LogPane)
        log = app.query_one("#log")
        pane.query_one("#log-level").value = "warning"
        await pilot.pause()
        shown_lines = "\n".join(strip.text for strip in log.lines)
        assert "[WARNING] Slow link to trainer" in shown_lines and "[SPARTA] Round 6 failed" in shown_lines
        assert "[TRAINING]" not in shown_lines and "[SYNC]" not in shown_lines
        pane.query_one("#log-level").value = "info"
        pane.query_one("#log-tag").value = "SYNC"
        await pilot.pause()
        shown_lines = "\n".join(strip.text for strip in log.lines)
        assert "[SYNC] Synchronising weights with peers." in shown_lines
        assert "[SPARTA]" not in shown_lines and "[WARNING]" not in shown_lines


async def test_keys_toggle_logs_open_help_and_export_a_bundle(tmp_path):
    config_dir = tmp_path / "config"
    (config_dir / "logs").mkdir(parents=True)
    (config_dir / "logs" / "gpu0.jsonl").write_text(dump_event(ExitEvent(ts=T0, code=0)) + "\n")
    bundle = BundleTarget(config_dir, config_dir / "logs", tmp_path / "out", ("hf_plantedSecret123456",))
    app = make_app("authorizing", "--hold", bundle=bundle)
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "authorizing")
        pane = app.query_one(LogPane)
        await pilot.press("l")
        assert not pane.display
        await pilot.press("l")
        assert pane.display
        await pilot.press("question_mark")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        assert type(app.screen).__name__ != "HelpScreen"
        await pilot.press("e")
        await until(pilot, lambda: app.last_bundle is not None)
    with zipfile.ZipFile(app.last_bundle) as archive:
        names = archive.namelist()
        assert "logs/gpu0.jsonl" in names and "recent.txt" in names
        assert "Authorizing with" in archive.read("recent.txt").decode()


async def test_palette_offers_the_app_commands():
    app = make_app("authorizing", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "authorizing")
        titles = [command.title for command in app.get_system_commands(app.screen)]
        assert {"Export support bundle", "Toggle logs", "Help", "Theme"} <= set(titles)
        assert "Restart worker" not in titles  # only offered once the worker stopped


def test_the_stepper_says_what_happens_between_steps():
    from agora_client.events import DownloadEvent, LogEvent, QueueEvent, SyncEvent
    from tui.state import JoinTracker

    tracker = JoinTracker()
    tracker.apply(DownloadEvent(status="started", file="params.safetensors"))
    assert tracker.apply(DownloadEvent(status="done")) and "Snapshot ready" in tracker.status
    assert tracker.apply(QueueEvent(position=0, estimated_wait_s=0))  # admitted at once: the queue step is said
    assert tracker.step == JoinStep.QUEUE and tracker.status == "Admitted: no wait in the join queue"
    tracker.apply(LogEvent(tag="JOIN", message="Worker up. Waiting for a calm moment..."))
    assert tracker.status == "Worker up. Waiting for a calm moment..."
    tracker.apply(SyncEvent(phase="sync1", message="Synchronising weights"))
    assert tracker.step == JoinStep.SYNC1


async def test_the_sync_panel_follows_the_epochs():
    from agora_client.events import StepEvent, SyncEvent
    from tui.widgets import SyncPanel

    app = make_app("sync1", "--hold")
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app, "sync1")
        panel = app.query_one(SyncPanel)
        panel.show(SyncEvent(phase="sync2", steps_left=4, steps_total=4, target_epoch=9, local_epoch=5))
        panel.follow(StepEvent(stage="head", local_epoch=7))
        await pilot.pause()
        assert "step 2 of 4 (local epoch 7)" in shown(panel)


def test_small_points_keep_their_digits():
    from tui.widgets.format import points_text, rate_text

    assert [points_text(v) for v in (0, 0.0333, 0.0000012, 1.5, 309.4)] == ["0", "0.0333", "1.2e-06", "1.50", "309"]
    assert rate_text(4_100_000) == "4.1 MB/s" and rate_text(12) == "12 B/s"
