"""Snapshot tests (SVG) of the app's key states, replayed from recorded streams.

Deterministic: fixed event timestamps, a fixed clock and UTC for the app's own lines, and
resources numbers from the fixtures (the app never probes the hardware itself).
Update after a reviewed change with: python -m pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import asyncio

import pytest
from textual.widgets import RichLog

from tui.widgets import LogPane, RuntimeStatus
from tests.replays import line_count, make_app


pytestmark = pytest.mark.timeout(120)


def wait_for(name: str, crashed: bool = False):
    expected = line_count(name)

    async def run_before(pilot) -> None:
        app = pilot.app
        for _ in range(400):
            stopped = app.query_one(RuntimeStatus).display and "runtime stopped" in "".join(app.query_one(LogPane).plain_lines()[-1:])
            done = app.lines_read >= expected and (not crashed or stopped)
            if done:
                break
            await asyncio.sleep(0.05)
        log = app.query_one("#log", RichLog)
        # the log pane renders its lines and scrolls to the last one after a refresh; a busy machine makes it late,
        # so wait until it is at the bottom and its lines have stopped changing between two looks
        previous = None
        for _ in range(200):
            await pilot.pause(0.05)
            rendered = (len(log.lines), log.max_scroll_y)
            if log.scroll_y >= log.max_scroll_y and rendered == previous:
                break
            previous = rendered
        await pilot.pause(0.2)

    return run_before


SIZES = {"80x24": (80, 24), "160x50": (160, 50)}  # the smallest usual terminal, and a large one


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ["authorizing", "downloading", "queued", "sync1", "sync2", "active", "no_gpu"])
def test_running_states(snap_compare, name, size):
    assert snap_compare(make_app(name, "--hold"), terminal_size=SIZES[size], run_before=wait_for(name))


@pytest.mark.parametrize("size", SIZES)
def test_child_crashed(snap_compare, size):
    app = make_app("crash", "--exit-code", "1")
    assert snap_compare(app, terminal_size=SIZES[size], run_before=wait_for("crash", crashed=True))


# Before authorization the preflight view takes the dashboard's place.
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ["preflight_running", "unreachable"])
def test_preflight_states(snap_compare, name, size):
    async def run_before(pilot) -> None:
        await wait_for(name)(pilot)
        for _ in range(100):  # the diagnosis' advice rows are mounted after the event
            if name != "unreachable" or pilot.app.query(".advice-row"):
                break
            await asyncio.sleep(0.05)
        await pilot.pause(0.2)

    assert snap_compare(make_app(name, "--hold"), terminal_size=SIZES[size], run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_preflight_failed(snap_compare, size):
    app = make_app("preflight_failed", "--exit-code", "1")
    assert snap_compare(app, terminal_size=SIZES[size], run_before=wait_for("preflight_failed", crashed=True))
