"""BridgedHosts (tests/netns.py): shaped uplinks that are really installed, hosts that reach each other across
the bridge, and nothing left behind (namespaces, bridge, veths, processes) whether the block ends normally or
by an exception. Fast: a few namespaces, no swarm."""

from __future__ import annotations

import os
import socket
import subprocess
from contextlib import nullcontext

import pytest

from tests.netns import BridgedHosts, unavailable

_SKIP = unavailable(shaping=True)
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


class Boom(Exception):
    pass


def _prefix() -> str:
    return f"agi15t-{os.getpid()}"


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30).stdout


def _own_interfaces() -> str:
    """The interfaces of the machine's own network namespace (this test runs there)."""
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True, timeout=30).stdout


def test_a_shaped_uplink_has_its_token_bucket_and_hosts_reach_each_other_across_the_bridge():
    with BridgedHosts(_prefix(), 3) as hosts:
        sender, receiver = hosts[1], hosts[2]
        sender.shape_uplink(8.0)
        qdisc = sender.run("tc", "qdisc", "show", "dev", sender.device).stdout
        assert "tbf" in qdisc and "rate 8Mbit" in qdisc, qdisc
        with receiver.entered():
            listener = socket.create_server((receiver.address, 0))
        with listener, sender.entered():
            with socket.create_connection((receiver.address, listener.getsockname()[1]), timeout=5) as client:
                accepted, peer = listener.accept()
                accepted.close()
                assert peer[0] == sender.address  # the connection came from the other host, not from loopback
                assert client.getsockname()[0] == sender.address


@pytest.mark.parametrize("ending", ["normal", "exception"])
def test_nothing_remains_after_the_block(ending):
    prefix = _prefix()
    hosts = BridgedHosts(prefix, 3)
    with pytest.raises(Boom) if ending == "exception" else nullcontext():
        with hosts:
            assert f"{prefix}-hub" in _namespaces()
            hosts[0].shape_uplink(1.0)
            with hosts[0].entered():
                sleeper = subprocess.Popen(["sleep", "60"])
            if ending == "exception":
                raise Boom
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace
    assert prefix not in _namespaces()
    interfaces = _own_interfaces()
    for name in [hosts.bridge, *hosts.ports, *(host.device for host in hosts.hosts)]:
        assert name not in interfaces
