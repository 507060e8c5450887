"""The client's port mapping (agora_client.network.PortMapping) against a real miniupnpd on a home router in
network namespaces (tests/netns_router.py).

From the home namespace, the mapping finds the router and forwards the worker's port: the internet side then
reaches a listener at home through the router's WAN address; the lease is renewed before it ends; close
removes the forward. Behind carrier-grade NAT the router refuses, and where no router answers there is
nothing to map: each is a MappingUnavailable saying which, never a crash.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time

import pytest

from tests.netns_router import HomeRouter, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
_SKIP = unavailable() or (None if importlib.util.find_spec("miniupnpc") else "pip install miniupnpc")
SHORT_LEASE_S = 2
CONNECT_TIMEOUT_S = 3.0
DROPPED_S = 1.0  # long enough for an answer on a veth; the router answers nothing to a port it does not forward


@pytest.fixture(scope="module")
def router():
    if _SKIP:
        pytest.skip(_SKIP)
    with HomeRouter(f"agiup-{os.getpid()}") as net:
        yield net


@pytest.fixture(scope="module")
def router_behind_carrier_grade_nat():
    if _SKIP:
        pytest.skip(_SKIP)
    with HomeRouter(f"agicg-{os.getpid()}", mapping="refused") as net:
        yield net


def _reach_home(net: HomeRouter, listener: socket.socket, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """Dial the router's WAN address from the internet; return the peer address the home listener saw."""
    with net.internet.entered(), socket.create_connection((net.wan_address, port), timeout=timeout_s) as dialer:
        accepted, peer = listener.accept()
        with accepted:
            accepted.sendall(b"home")
        assert dialer.recv(16) == b"home"
    return peer[0]


@pytest.fixture
def home_listener(router):
    with router.home.entered():
        listener = socket.create_server((router.home.address, 0))
    listener.settimeout(CONNECT_TIMEOUT_S)
    with listener:
        yield listener


def _mapping(port: int, **kwargs):
    from agora_client.network import PortMapping

    renewal_failures: list[str] = []
    return PortMapping(port, on_renewal_failed=renewal_failures.append, **kwargs), renewal_failures


def test_port_mapping_forwards_the_worker_port_and_removes_it_on_close(router, home_listener):
    net = router
    port = home_listener.getsockname()[1]
    with pytest.raises(TimeoutError):  # nothing forwarded yet: the router drops what the internet opens towards it
        _reach_home(net, home_listener, port, timeout_s=DROPPED_S)
    mapping, failures = _mapping(port)
    with net.home.entered():
        mapped = mapping.open()
    try:
        assert (mapped.external_host, mapped.external_port, mapped.internal_host, mapped.internal_port) == (
            net.wan_address,
            port,
            net.home.address,
            port,
        )
        [held] = net.mappings()
        assert (held.external_port, held.internal_address, held.internal_port) == (port, net.home.address, port)
        assert abs(held.expires_at - time.time() - mapped.lease_s) <= 2 and mapped.lease_s > 0
        assert _reach_home(net, home_listener, mapped.external_port) == net.internet.address  # the dialer's own address
    finally:
        with net.home.entered():
            mapping.close()
    assert net.mappings() == [] and failures == []
    with pytest.raises(TimeoutError):
        _reach_home(net, home_listener, port, timeout_s=DROPPED_S)


def test_port_mapping_renews_its_lease_before_it_ends(router, home_listener):
    net = router
    port = home_listener.getsockname()[1]
    mapping, failures = _mapping(port, lease_s=SHORT_LEASE_S)
    with net.home.entered():
        mapping.open()  # the renewal thread starts here, in the home namespace
    try:
        [first] = net.mappings()
        time.sleep(SHORT_LEASE_S * 2)  # two leases: without renewals the router would have dropped it
        [renewed] = net.mappings()
        assert renewed.expires_at > first.expires_at and failures == []
        assert _reach_home(net, home_listener, port) == net.internet.address
    finally:
        with net.home.entered():
            mapping.close()
    assert net.mappings() == []


def test_home_reaches_the_internet_through_the_routers_nat(router):
    net = router
    with net.internet.entered():
        listener = socket.create_server((net.internet.address, 0))
    with listener, net.home.entered(), socket.create_connection(listener.getsockname(), timeout=CONNECT_TIMEOUT_S):
        listener.settimeout(CONNECT_TIMEOUT_S)
        _, peer = listener.accept()
    assert peer[0] == net.wan_address  # masqueraded: the internet never sees the LAN address


def test_port_mapping_behind_carrier_grade_nat_is_refused_in_the_routers_words(router_behind_carrier_grade_nat):
    from agora_client.network import MappingUnavailable

    net = router_behind_carrier_grade_nat
    mapping, _ = _mapping(40123)
    with net.home.entered(), pytest.raises(MappingUnavailable) as refused:
        mapping.open()
    assert refused.value.offered and "the router refused to forward TCP port 40123" in str(refused.value)
    assert "Action Failed" in str(refused.value) and mapping.router_external == ""  # it names no shared address
    assert net.mappings() == []
    assert f"Reserved / private IP address {net.wan_address}" in net.router_log()


def test_port_mapping_without_a_router_says_none_answered(router):
    from agora_client.network import MappingUnavailable

    mapping, _ = _mapping(40124)
    with router.internet.entered(), pytest.raises(MappingUnavailable) as absent:  # no UPnP device on that side
        mapping.open()
    assert not absent.value.offered
    assert str(absent.value) == "no router on this network answered a UPnP search or a NAT-PMP request"


def test_port_mapping_refused_by_the_routers_config_is_one_clear_refusal(router):
    from agora_client.network import MappingUnavailable

    router.switch_upnp("denied")
    try:
        mapping, _ = _mapping(40125)
        with router.home.entered(), pytest.raises(MappingUnavailable) as refused:
            mapping.open()
        assert refused.value.offered and mapping.router_external == router.wan_address
        # miniupnpd 2.3.1 leaves a NAT-PMP request its rules deny unanswered: UPnP's refusal is the one said
        assert (
            str(refused.value) == "the router refused to forward TCP port 40125 to this machine (Action not authorized)"
        )
        assert router.mappings() == []
    finally:
        router.switch_upnp("on")


def test_port_mapping_over_natpmp_where_the_router_has_upnp_off(router, home_listener):
    net = router
    port = home_listener.getsockname()[1]
    net.switch_upnp("natpmp")
    try:
        mapping, failures = _mapping(port, lease_s=SHORT_LEASE_S)
        with net.home.entered():
            mapped = mapping.open()
        try:
            assert mapping.protocol == "NAT-PMP" and mapped.external_host == net.wan_address
            assert (mapped.internal_host, mapped.internal_port, mapped.lease_s) == (
                net.home.address,
                port,
                SHORT_LEASE_S,
            )
            [first] = net.mappings()
            assert (first.external_port, first.internal_address, first.internal_port) == (
                mapped.external_port,
                net.home.address,
                port,
            )
            time.sleep(SHORT_LEASE_S * 2)  # two leases: renewed over NAT-PMP, or the router would have dropped it
            [renewed] = net.mappings()
            assert renewed.expires_at > first.expires_at and failures == []
            assert _reach_home(net, home_listener, mapped.external_port) == net.internet.address
        finally:
            with net.home.entered():
                mapping.close()
        assert net.mappings() == []
        with pytest.raises(TimeoutError):
            _reach_home(net, home_listener, mapped.external_port, timeout_s=DROPPED_S)
    finally:
        net.switch_upnp("on")
