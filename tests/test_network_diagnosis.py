"""The network diagnosis: which NAT the three addresses (local, router's external, seen by the swarm) reveal,
and the one thing to do about each finding."""

from __future__ import annotations

from agora_client.network.diagnosis import NetworkFacts, diagnose

LAN, ROUTER_PUBLIC = "192.168.1.20", "81.2.69.142"


def test_a_public_machine_is_reported_without_nat_or_findings():
    report = diagnose(NetworkFacts("203.0.113.9", 49200, "not offered", seen_address="203.0.113.9"))
    assert (report.nat, report.carrier_grade_nat, report.double_nat, report.findings) == (False, False, False, [])


def test_a_home_router_without_upnp_gets_the_port_to_forward():
    report = diagnose(NetworkFacts(LAN, 49200, "not offered", seen_address=ROUTER_PUBLIC))
    assert report.nat and not report.carrier_grade_nat and not report.double_nat
    [finding] = report.findings
    assert "offered automatic port mapping" in finding.what
    assert "Turn on UPnP" in finding.action and f"forward TCP port 49200 to {LAN}" in finding.action


def test_a_refused_mapping_quotes_the_router():
    report = diagnose(NetworkFacts(LAN, 49201, "refused", "ConflictInMappingEntry", ROUTER_PUBLIC, ROUTER_PUBLIC))
    [finding] = report.findings
    assert "refused to open the port: ConflictInMappingEntry" in finding.what and "49201" in finding.action


def test_a_mapped_port_needs_nothing_from_the_user():
    report = diagnose(NetworkFacts(LAN, 49200, "mapped", router_external=ROUTER_PUBLIC, seen_address=ROUTER_PUBLIC))
    assert report.nat and report.findings == []


def test_a_shared_address_range_is_carrier_grade_nat_and_no_home_forward_is_advised():
    report = diagnose(NetworkFacts(LAN, 49200, "refused", "private WAN", "100.72.3.4", ROUTER_PUBLIC))
    assert report.carrier_grade_nat and not report.double_nat
    [finding] = report.findings  # the refused mapping is no finding of its own: it could not help
    assert "Carrier-grade NAT" in finding.what and "100.72.3.4" in finding.what and ROUTER_PUBLIC in finding.what
    assert "agora relay" in finding.action and "public IPv4" in finding.action


def test_a_router_address_the_swarm_does_not_see_is_carrier_grade_nat():
    report = diagnose(NetworkFacts(LAN, 49200, "mapped", router_external="81.2.69.160", seen_address=ROUTER_PUBLIC))
    assert report.carrier_grade_nat and len(report.findings) == 1


def test_a_router_with_a_private_internet_side_is_double_nat():
    report = diagnose(NetworkFacts(LAN, 49200, "mapped", router_external="192.168.0.2", seen_address=ROUTER_PUBLIC))
    assert report.double_nat and not report.carrier_grade_nat
    [finding] = report.findings
    assert "Double NAT" in finding.what and "bridge mode" in finding.action and "192.168.0.2" in finding.action
