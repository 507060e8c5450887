"""PortMapping's answers to what real routers say besides yes, with a stand-in for miniupnpc's gateway client
(a real miniupnpd in secure mode cannot be made to hold a port for another machine, nor to refuse leases)."""

from __future__ import annotations

import threading

import pytest

from agora_client.network import port_mapping
from agora_client.network.port_mapping import PortMapping


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
    monkeypatch.setattr(port_mapping.miniupnpc, "UPnP", lambda: gateway)
    return PortMapping(port, on_renewal_failed=lambda reason: None)


def test_an_external_port_another_machine_holds_is_skipped_for_the_next(monkeypatch):
    gateway = _Gateway(taken={49200, 49201})
    mapping = _mapping(monkeypatch, gateway)
    mapped = mapping.open()
    assert (mapped.external, mapped.internal_port) == ("81.2.69.142:49202", 49200) and gateway.added == {49202: 3600}
    mapping.close()
    assert gateway.added == {}


def test_when_every_nearby_external_port_is_taken_the_refusal_says_so(monkeypatch):
    gateway = _Gateway(taken=set(range(49200, 49200 + port_mapping.EXTERNAL_PORT_TRIES)))
    with pytest.raises(port_mapping.MappingUnavailable, match="ConflictInMappingEntry") as refused:
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
