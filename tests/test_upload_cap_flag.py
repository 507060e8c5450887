"""--max-upload-mbit from the client to the runtime: saved in the config dir, passed on, refused when it cannot be
held; the cap and the rate in use in the traffic event and the headless line."""

from __future__ import annotations

import argparse
import json

import pytest

from agora_client.client_config import ClientConfigError, ClientConfigStore
from agora_client.events import TrafficEvent
from agora_client.frontend.lines import LineFormatter
from agora_client.serving.traffic import RequestMeter, TrafficWindow
from agora_client.upload_cap import MBIT, UploadCap


@pytest.fixture
def runtime_argv(monkeypatch, tmp_path):
    from agora_client.cli import build_parser
    from agora_client.frontend.client import prepare

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")

    def argv(*flags: str) -> tuple[str, ...]:
        # --allow-write-token: no Hugging Face here to ask what the token may do (test_token_scope.py)
        base = ["--headless", "--swarm", "http://127.0.0.1:9", "--config-dir", str(tmp_path), "--allow-write-token"]
        session = prepare(build_parser().parse_args([*base, *flags]))
        assert not isinstance(session, int)
        command = session.command.argv
        return command[command.index("runtime") :]

    return argv


def cap_of(argv: tuple[str, ...]) -> str | None:
    return argv[argv.index("--max-upload-mbit") + 1] if "--max-upload-mbit" in argv else None


def test_the_cap_is_saved_passed_to_the_runtime_and_0_removes_it(runtime_argv, tmp_path):
    assert cap_of(runtime_argv()) is None  # no cap unless asked for
    assert cap_of(runtime_argv("--max-upload-mbit", "8")) == "8.0"
    assert ClientConfigStore(tmp_path).load().max_upload_mbit == 8.0
    assert cap_of(runtime_argv()) == "8.0"  # the next run keeps it
    assert cap_of(runtime_argv("--reconfigure", "--max-upload-mbit", "12.5")) == "12.5"
    assert cap_of(runtime_argv("--max-upload-mbit", "0")) is None
    assert cap_of(runtime_argv()) is None


def runtime_parser() -> argparse.ArgumentParser:
    from agora_client import runtime

    parser = argparse.ArgumentParser(prog="agora runtime")
    runtime.configure(parser)
    return parser


@pytest.mark.parametrize("bad", ["1", "-2", "lots", "nan"])
def test_a_cap_that_cannot_be_held_is_refused_by_the_client_and_the_runtime(bad, capsys):
    from agora_client.cli import build_parser

    for parser in (build_parser(), runtime_parser()):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(["--swarm", "http://x", "--max-upload-mbit", bad])
        assert caught.value.code == 2
        assert "--max-upload-mbit" in capsys.readouterr().err


def test_the_runtime_takes_the_flag():
    assert runtime_parser().parse_args(["--swarm", "http://x", "--max-upload-mbit", "20"]).max_upload_mbit == 20.0
    assert runtime_parser().parse_args(["--swarm", "http://x"]).max_upload_mbit == 0.0


def test_a_bad_saved_cap_says_where_it_is(runtime_argv, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"swarm_url": "http://127.0.0.1:9", "max_upload_mbit": 0.5}))
    with pytest.raises(ClientConfigError, match=r"config.json: max_upload_mbit: .*below the 2 Mbit/s"):
        ClientConfigStore(tmp_path).load()


def test_the_traffic_event_carries_the_cap_and_the_announced_uplink_and_headless_says_them():
    cap = UploadCap(8.0)
    window = TrafficWindow(RequestMeter(), upload_cap_bps=cap.bytes_per_s, announced_uplink=lambda: 6 * MBIT)
    event = window.sample()
    assert (event.upload_cap_bps, event.announced_uplink_bps) == (1e6, 6 * MBIT)
    formatter = LineFormatter()
    capped = TrafficEvent(ts=100.0, upload_bps=0.5e6, upload_cap_bps=1e6, announced_uplink_bps=1e6)
    (line,) = formatter.format(capped)
    assert line.render() == "[PROGRESS] Uploading 4 Mbit/s of the 8 Mbit/s cap; announcing 8 Mbit/s to averaging groups"
    assert formatter.format(capped.model_copy(update={"ts": 130.0})) == []  # once a minute at most
    assert len(formatter.format(capped.model_copy(update={"ts": 161.0}))) == 1
    assert LineFormatter().format(TrafficEvent(ts=1.0, upload_bps=9e6)) == []  # no cap: nothing to say


async def test_the_bandwidth_panel_shows_the_cap_beside_the_upload():
    from textual.app import App, ComposeResult

    from tui.widgets import NetworkPanel

    class OnePanel(App):
        def compose(self) -> ComposeResult:
            yield NetworkPanel()

    app = OnePanel()
    async with app.run_test(size=(80, 24)) as pilot:
        panel = app.query_one(NetworkPanel)
        panel.show(TrafficEvent(ts=1.0, upload_bps=0.5e6, bytes_sent=10**9, upload_cap_bps=1e6))
        await pilot.pause()
        detail = str(panel.query_one(".detail").render())
        assert "↑ 500.0 KB/s" in detail and "upload cap 8 Mbit/s" in detail, detail
        panel.show(TrafficEvent(ts=2.0, upload_bps=0.5e6))
        await pilot.pause()
        assert "cap" not in str(panel.query_one(".detail").render())
