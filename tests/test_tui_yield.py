"""The app while the worker yields the GPU to its owner (issue 30, part 6): the status band's GPU cell says so,
the GPU panel and the headline say why, the panel how long the slot is kept, and the points panel gives energy and
points per kWh; at 80x24 and at 160x50. The stream is a replayed recording (tests/fixtures/events/yielding.jsonl).
Space pauses and resumes the runtime through its control socket (agora_client/system/pause_control.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.geometry import Region

from agora_client.frontend.client import ClientSession
from agora_client.system.gpu_yield import YieldPolicy
from agora_client.system.pause_control import PauseServer
from tests.replays import line_count, make_app, replay, until
from tui.widgets import PointsPanel
from tui.widgets.gpu import GpuPanel
from tui.widgets.status_band import FigureCell
from tui.widgets.stepper import Stepper

pytestmark = pytest.mark.timeout(120)


def drawn(widget) -> str:
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, *widget.outer_size)))


@pytest.mark.parametrize("size", [(80, 24), (160, 50)])
async def test_the_app_shows_that_it_yields_why_and_the_energy(size: tuple[int, int]) -> None:
    app = make_app("yielding", "--hold")
    async with app.run_test(size=size) as pilot:
        await until(pilot, lambda: app.lines_read >= line_count("yielding"))
        await pilot.pause()
        cell = drawn(app.query_one("#band-gpu", FigureCell))
        assert "yielding" in cell and "GB" not in cell  # a later resources sample does not hide it
        gpu = drawn(app.query_one(GpuPanel))
        assert "yielding" in gpu and "Cyberpunk2077" in gpu
        assert "Yielding the GPU" in drawn(app.query_one(Stepper))  # the headline says why nothing is served
        detail = str(app.query_one(PointsPanel).query_one(".detail").render())
        assert "energy 0.350 kWh" in detail and "120 points/kWh" in detail


async def test_space_pauses_the_runtime_through_its_control_socket_and_resumes_it(tmp_path: Path) -> None:
    policy = YieldPolicy("never")
    control = PauseServer(tmp_path, None, policy)  # the runtime's end, as `agora runtime --cpu` opens it
    control.start()
    session = ClientSession(command=replay("yielding", "--hold"), config_dir=tmp_path, gpu=None)
    app = make_app("yielding", "--hold", pause_control=session.toggle_pause)
    try:
        async with app.run_test(size=(100, 34)) as pilot:
            await until(pilot, lambda: app.runtime_running)
            await pilot.press("space")
            await until(pilot, lambda: policy.paused)
            await pilot.press("space")
            await until(pilot, lambda: not policy.paused)
    finally:
        control.close()
