"""The preflight's upload check: the auth service's front times an upload's arrival and drops it
(http_service/upload_probe.py); the contributor sends for a few seconds at most and reads its uplink from that.
Measured on loopback against the real auth service, and across a bridge from a host whose uplink is shaped with
tc tbf to 8 Mbit/s, where the figure must be the shaped rate, not the sender's write speed."""

from __future__ import annotations

import os

import pytest

from agora_client.auth.uplink_probe import UPLOAD_PROBE_PATH, UplinkProbeFailed, measure_uplink
from agora_client.http_service import HttpService, json_reply
from agora_client.http_service.upload_probe import UPLOAD_PROBE_MAX_BYTES
from agora_client.joining.preflight import check_upload_rate
from tests.netns import BridgedHosts, unavailable
from tests.test_join_from_url import closed_port, describe, service

SHAPED_MBIT = 8.0


def test_the_upload_check_measures_against_the_real_auth_service_and_names_the_round_it_implies(tmp_path):
    run = describe("tiny2")
    with service(tmp_path) as (server, _):
        check = check_upload_rate(run, server.url)
    assert check.status == "pass", check  # loopback: far above 10 Mbit/s
    assert "Mbit/s) over" in check.value and not check.value.startswith("0 B/s")
    assert "largest stage" in check.reason and "each way" in check.reason


def test_an_unreachable_service_or_an_oversized_probe_is_a_warning_not_a_failure(tmp_path):
    dead = check_upload_rate(describe("tiny2"), f"http://127.0.0.1:{closed_port()}")
    assert dead.status == "warn" and dead.value == "not measured" and "averaging rounds" in dead.reason
    with service(tmp_path) as (server, _):
        with pytest.raises(UplinkProbeFailed, match="413"):
            measure_uplink(server.url, max_bytes=UPLOAD_PROBE_MAX_BYTES + (1 << 20), max_s=60.0)
        assert measure_uplink(server.url, max_bytes=1 << 20).received == 1 << 20  # the service keeps serving


_SKIP = unavailable(shaping=True)


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_the_figure_is_the_shaped_uplink_not_the_senders_write_speed():
    with BridgedHosts(f"agiup-{os.getpid()}", 2) as hosts:
        home, swarm = hosts[0], hosts[1]
        home.shape_uplink(SHAPED_MBIT)
        with swarm.entered():  # the listening socket is made here, in the swarm host's namespace
            front = HttpService(
                lambda request: json_reply(404, {}),
                swarm.address,
                0,
                name="probe",
                upload_probes=[("POST", UPLOAD_PROBE_PATH)],
            )
        front.start()
        try:
            with home.entered():
                measured = measure_uplink(f"http://{swarm.address}:{front.address[1]}", max_bytes=4 << 20, max_s=3.0)
        finally:
            front.close()
    mbit = measured.bytes_per_s * 8 / 1e6
    assert 0.5 * SHAPED_MBIT <= mbit <= 1.25 * SHAPED_MBIT, (
        f"{mbit:.1f} Mbit/s measured over a {SHAPED_MBIT} Mbit/s uplink"
    )
