"""Snapshot tests (SVG) of the app's key states, replayed from recorded streams.

Deterministic: fixed event timestamps, a fixed clock and UTC for the app's own lines, and
resources numbers from the fixtures (the app never probes the hardware itself).
Update after a reviewed change with: python -m pytest tests/test_tui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import asyncio

import pytest
from textual.geometry import Region
from textual.widgets import RichLog

from tests.replays import line_count, make_app
from tui.widgets import LogPane, RuntimeStatus, StagesPanel
from tui.widgets.status_band import FigureCell

pytestmark = pytest.mark.timeout(120)


def wait_for(name: str, crashed: bool = False):
    expected = line_count(name)

    async def run_before(pilot) -> None:
        app = pilot.app
        for _ in range(400):
            stopped = app.query_one(RuntimeStatus).display and "runtime stopped" in "".join(
                app.query_one(LogPane).plain_lines()[-1:]
            )
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
# What the status band must show of each state, at both sizes (the long forms at 160 columns hold the short ones'
# figures).
FIGURES = {
    "authorizing": {"Auth": "asking"},
    "downloading": {"Auth": "✔ alice", "Download": "46%"},
    "queued": {"Download": "✔ 480", "Queue": "#2", "GPU": "3.1/25.8 GB"},
    "sync1": {"Queue": "✔ admitted", "Sync": "1 ", "SPARTA": "2/2", "Points": "0.6"},
    "sync2": {"Sync": "2 ", "Points": "+"},
    "active": {"Sync": "✔ active", "GPU": "18.2/25.8 GB", "SPARTA": "15/18", "Points": "309 +55/h", "Loss": "4.647"},
    "no_gpu": {"GPU": "RAM 2.3 GB"},
}


def visible_text(widget) -> str:
    """What ``widget`` draws on the screen, as text."""
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, *widget.outer_size)))


def assert_band_shows(app, figures: dict[str, str]) -> None:
    """Every figure is drawn in the band, whole, inside the terminal (nothing to scroll to)."""
    for cell in app.query(FigureCell):
        assert app.screen.region.contains_region(cell.region), f"{cell.label} is outside the screen"
        if cell.label in figures:
            assert figures[cell.label] in visible_text(cell), f"{cell.label}: {visible_text(cell)!r}"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ["authorizing", "downloading", "queued", "sync1", "sync2", "active", "no_gpu"])
def test_running_states(snap_compare, name, size):
    async def run_before(pilot) -> None:
        await wait_for(name)(pilot)
        assert_band_shows(pilot.app, FIGURES[name])

    assert snap_compare(make_app(name, "--hold"), terminal_size=SIZES[size], run_before=run_before)


# The swarm view: every stage's workers, queue and replica drift (a dash before any of its workers has averaged), the
# throughput, this worker's share, SPARTA health and spot checks.
SWARM_VIEW = [
    "stage      active syncing queued   of   drift  spot checks",
    "› body1         3       1      2    8   3.12%  ● calibrating 420",
    "  body2         2       0      0    8  0.087%  ✔ verifiable 600",
    "  tail          1       0      0    8       –  none +1 unhealthy",
    "swarm 19,605 tokens/s · 2 trainer(s)",
    "your share of body1: 27% (fair share 25% of 4)",
    "body1 SPARTA: ✔ healthy · 15/18 rounds ok (83%) · last group 3 of 3 active",
    "body1 spot checks: 420 checks · 1 strike · 0 bans · ● calibrating",
]


@pytest.mark.parametrize("size", SIZES)
def test_swarm_tab(snap_compare, size):
    async def run_before(pilot) -> None:
        await wait_for("active")(pilot)
        await pilot.press("2")
        await pilot.pause(0.3)
        stages = pilot.app.query_one(StagesPanel)
        assert pilot.app.screen.region.contains_region(stages.region)  # no scrolling to see it
        assert all(line in visible_text(stages) for line in SWARM_VIEW), visible_text(stages)

    assert snap_compare(make_app("active", "--hold"), terminal_size=SIZES[size], run_before=run_before)


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
