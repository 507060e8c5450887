"""PortMapping's answers to what real routers say besides yes, with stand-ins for miniupnpc's gateway client and
for NAT-PMP's answers (a real miniupnpd in secure mode cannot be made to hold a port for another machine, nor to
refuse leases; these stand-ins send nothing onto the machine's own network)."""

from __future__ import annotations

import threading

import pytest

from agora_client.network import MappedPort, MappingUnavailable, natpmp_gateway, upnp_gateway
from agora_client.network.natpmp_gateway import NatPmpGateway
from agora_client.network.port_mapping import PortMapping
from agora_client.network.upnp_gateway import UpnpGateway


class _Gateway:
    """miniupnpc.UPnP's surface as PortMapping uses it; ``taken`` external ports belong to another machine."""

    def __init__(self, taken: set[int], permanent_only: bool = False):
        self.taken, self.permanent_only = taken, permanent_only
        self.discoverdelay, self.lanaddr = 0, "192.168.1.20"
        self.added: dict[int, int] = {}  # external port -> lease

    def discover(self) -> int:
        return 1

    def selectigd(self) -> str:
        return "http://192.168.1.1:5000/rootDesc.xml"

    def externalipaddress(self) -> str:
        return "81.2.69.142"

    def addportmapping(self, external, protocol, host, internal, description, remote, lease) -> bool:
        if external in self.taken:
            raise Exception("ConflictInMappingEntry")
        if self.permanent_only and lease:
            raise Exception("OnlyPermanentLeasesSupported")
        self.added[external] = lease
        return True

    def deleteportmapping(self, external, protocol) -> bool:
        self.added.pop(external, None)
        return True


def _mapping(monkeypatch, gateway: _Gateway, port: int = 49200) -> PortMapping:
    monkeypatch.setattr(upnp_gateway.miniupnpc, "UPnP", lambda: gateway)
    return PortMapping(port, on_renewal_failed=lambda reason: None, gateways=[UpnpGateway()])


def test_an_external_port_another_machine_holds_is_skipped_for_the_next(monkeypatch):
    gateway = _Gateway(taken={49200, 49201})
    mapping = _mapping(monkeypatch, gateway)
    mapped = mapping.open()
    assert (mapped.external, mapped.internal_port) == ("81.2.69.142:49202", 49200) and gateway.added == {49202: 3600}
    mapping.close()
    assert gateway.added == {}


def test_when_every_nearby_external_port_is_taken_the_refusal_says_so(monkeypatch):
    gateway = _Gateway(taken=set(range(49200, 49200 + upnp_gateway.EXTERNAL_PORT_TRIES)))
    with pytest.raises(MappingUnavailable, match="ConflictInMappingEntry") as refused:
        _mapping(monkeypatch, gateway).open()
    assert refused.value.offered


def test_a_router_that_takes_only_permanent_forwards_gets_one_and_no_renewals(monkeypatch):
    gateway = _Gateway(taken=set(), permanent_only=True)
    mapping = _mapping(monkeypatch, gateway)
    mapped = mapping.open()
    assert mapped.lease_s == 0 and gateway.added == {49200: 0}
    assert "port-mapping-renewal" not in [thread.name for thread in threading.enumerate()]
    mapping.close()
    assert gateway.added == {}


class _StandIn:
    """A router protocol that is absent, refuses (as a router with it turned off in its settings does) or grants."""

    router_external = "81.2.69.142"

    def __init__(self, protocol: str, answer: str, reason: str = ""):
        self.protocol, self.answer, self.reason = protocol, answer, reason
        self.removed: list[MappedPort] = []

    def find(self) -> None:
        if self.answer == "absent":
            raise MappingUnavailable(self.reason, offered=False)

    def add(self, port: int, lease_s: int) -> MappedPort:
        if self.answer == "refuses":
            raise MappingUnavailable(self.reason, offered=True)
        return MappedPort(self.router_external, port + 1, "192.168.1.20", port, lease_s)

    def remove(self, mapped: MappedPort) -> None:
        self.removed.append(mapped)


def test_when_upnp_refuses_nat_pmp_is_asked_and_its_forward_is_the_one_held_and_removed():
    upnp, natpmp = _StandIn("UPnP", "refuses", "UPnP says no"), _StandIn("NAT-PMP", "grants")
    mapping = PortMapping(49200, on_renewal_failed=lambda reason: None, gateways=[upnp, natpmp], lease_s=0)
    mapped = mapping.open()
    assert mapped.external == "81.2.69.142:49201" and mapping.protocol == "NAT-PMP"  # the router chose the port
    mapping.close()
    assert natpmp.removed == [mapped] and upnp.removed == []


def test_refusals_are_said_in_the_routers_words_and_absence_is_no_refusal():
    both = PortMapping(
        1,
        lambda reason: None,
        gateways=[_StandIn("UPnP", "absent", "no UPnP"), _StandIn("NAT-PMP", "refuses", "NAT-PMP says no")],
    )
    with pytest.raises(MappingUnavailable, match="^NAT-PMP says no$") as refused:
        both.open()
    assert refused.value.offered and both.router_external == "81.2.69.142" and both.protocol == ""
    neither = PortMapping(
        1, lambda reason: None, gateways=[_StandIn("UPnP", "absent", "no UPnP"), _StandIn("NAT-PMP", "absent", "none")]
    )
    with pytest.raises(MappingUnavailable, match="answered a UPnP search or a NAT-PMP request") as absent:
        neither.open()
    assert not absent.value.offered


def test_the_default_gateway_is_read_from_the_routing_table(tmp_path, monkeypatch):
    routes = tmp_path / "route"
    routes.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
        "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\n"
    )
    assert natpmp_gateway.default_gateway(routes) == "192.0.2.1"
    routes.write_text("Iface\tDestination\tGateway \tFlags\n")
    assert natpmp_gateway.default_gateway(routes) == "" and natpmp_gateway.default_gateway(tmp_path / "none") == ""
    monkeypatch.setattr(natpmp_gateway, "default_gateway", lambda: "")
    with pytest.raises(MappingUnavailable, match="no default gateway") as absent:
        NatPmpGateway().find()
    assert not absent.value.offered
