"""NetworkPath's choice after a failed dial-back: a relay of the run not yet tried is tried at once (the contributor
skips the retry's wait for it); once tried, later failed dial-backs wait."""

from __future__ import annotations

import io
import json
import socket

from agora_client.events import EventWriter
from agora_client.joining.network_path import NetworkPath


def _closed_port() -> int:
    """A loopback port nothing listens on: a relay there refuses at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_listed_relay_is_untried_until_the_path_asks_it_and_a_refusal_is_one_line():
    sink = io.StringIO()
    relay = f"127.0.0.1:{_closed_port()}"
    path = NetworkPath(
        _closed_port(),
        "http://127.0.0.1:8440",
        EventWriter(sink),
        port_mapping=False,
        announce_addr=None,
        relays=(relay,),
    )
    assert path.relay_untried and not path.open()  # mapping off: no new way in from the router
    assert not path.use_relay("pass") and not path.relay_untried and path.kind == "direct"
    said = [json.loads(line)["message"] for line in sink.getvalue().splitlines()]
    assert [line for line in said if line.startswith(f"Relay {relay}:")] == said[-1:]


def test_a_run_without_relays_has_none_to_try():
    path = NetworkPath(
        _closed_port(), "http://127.0.0.1:8440", EventWriter(), port_mapping=False, announce_addr=None, relays=()
    )
    assert not path.relay_untried
