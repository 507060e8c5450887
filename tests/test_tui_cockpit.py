"""Pilot test of the cockpit at 80x24: the charts take their values from a recorded event stream and draw
them on labelled axes, in the tabs that the keys 1-4 open; l opens the Log tab (the swarm view: test_tui_snapshots)."""

from __future__ import annotations

import json

import pytest
from textual.geometry import Region

from tests.replays import FIXTURES, line_count, make_app, until
from tui.widgets import Dashboard, LogPane, LossPanel, NetworkPanel, PointsPanel, TokensPanel, TrainingPanel

pytestmark = pytest.mark.timeout(120)
SMALL = (80, 24)


def recorded(kind: str) -> list[dict]:
    return [
        event
        for event in map(json.loads, (FIXTURES / "active.jsonl").read_text().splitlines())
        if event["kind"] == kind
    ]


def drawn(widget) -> str:
    """What ``widget`` draws, as text."""
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, *widget.outer_size)))


def axes(chart) -> tuple[list[str], str]:
    """A chart as drawn: the rows with y ticks at their left, and the last row with the axes' labels."""
    rows = drawn(chart).splitlines()
    return rows[:-1], rows[-1]


async def test_the_tabs_draw_the_recorded_values_on_labelled_axes_and_l_opens_the_log_tab():
    app = make_app("active", "--hold")
    async with app.run_test(size=SMALL) as pilot:
        await until(pilot, lambda: app.lines_read >= line_count("active"))
        swarm, traffic, points = recorded("swarm"), recorded("traffic"), recorded("points")
        tokens = app.query_one(TokensPanel).chart
        assert list(tokens.series["tokens"]) == [(event["ts"], event["tokens_per_s"]) for event in swarm]
        loss = app.query_one(LossPanel).chart
        assert list(loss.series["eval"]) == [tuple(point) for point in swarm[-1]["eval_history"]]
        network = app.query_one(NetworkPanel).chart
        assert list(network.series["down"]) == [(event["ts"], event["download_bps"]) for event in traffic]
        assert [value for _, value in app.query_one(TrainingPanel).chart.series["forward"]] == [
            event["forward_per_min"] for event in traffic
        ]
        assert list(app.query_one(PointsPanel).chart.series["local"]) == [
            (event["ts"], event["presence"] + event["compute"]) for event in points
        ]
        assert list(app.query_one(PointsPanel).chart.series["confirmed"]) == [(points[-1]["ts"], 224.0)]
        assert "https://monitor.example/contributors/alice" in str(
            app.query_one(PointsPanel).query_one(".detail").render()
        )

        # the axes as drawn: the unit on top, the values' scale at the left, clock times and "time" below
        points_chart = app.query_one(PointsPanel).chart
        for key, chart, unit, ticks, now in (
            ("1", points_chart, "points", ["200", "0"], "local 309"),  # a short chart: a tick every other row
            ("2", loss, "loss", ["5.4", "4.8"], "loss 4.647 · ━ eval 4.830"),
            ("2", tokens, "tokens/s", ["20k", "0"], "tokens/s 19,605"),
            ("3", network, "MB/s", ["4", "0"], "up ↑ 4.1 MB/s · ━ down ↓ 3.2 MB/s"),
        ):
            await pilot.press(key)
            await pilot.pause(0.2)
            rows, labels = axes(chart)
            assert labels.split() == [unit, "time"]  # the y axis' unit, then the x axis' label
            y_ticks = [row.split("┤")[0].strip() for row in rows if "┤" in row]
            assert y_ticks[0] == ticks[0] and y_ticks[-1] == ticks[-1], y_ticks  # top and bottom of the scale
            assert "00:10" in rows[-1] and "00:20" in rows[-1]  # clock times under the x axis
            assert now in drawn(chart.parent.query_one(".detail"))  # the current values above the chart

        # 24 rows: the charts take them, and the log is a tab that l opens and closes
        dashboard, pane = app.query_one(Dashboard), app.query_one(LogPane)
        assert dashboard.active == "tab-network" and not pane.display
        await pilot.press("l")
        await pilot.pause(0.1)
        assert dashboard.active == "tab-log" and pane.display and pane.region.height > 12
        assert "[WARNING] Slow link to trainer" in drawn(pane.query_one("#log"))
        await pilot.press("l")
        await pilot.pause(0.1)
        assert dashboard.active == "tab-network" and not pane.display
