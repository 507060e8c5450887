"""What the network between this machine and the swarm does, in plain words, each finding with the one thing to do.

Read from three addresses: this machine's own (towards the swarm), the one its router says it has on the
internet side (UPnP), and the one the swarm's auth service saw the join come from. Where they differ
there is a NAT; a router whose own internet side is a private address sits behind another router
(double NAT); an address in 100.64.0.0/10, or a router address the swarm does not see, is the
provider's shared NAT (carrier-grade NAT), where no forward at home helps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agora_client.events import NetworkFinding as Finding
from agora_client.events import NetworkReport
from agora_client.network.addresses import is_carrier_grade, is_private

MappingState = Literal["mapped", "refused", "not offered", "off"]


@dataclass(frozen=True)
class NetworkFacts:
    """The addresses and the router's answer; empty text where a fact is not known (yet)."""

    local_address: str
    port: int
    mapping: MappingState
    mapping_detail: str = ""  # the router's refusal, or where the forward goes
    router_external: str = ""  # what the router says its internet side is
    seen_address: str = ""  # where the auth service saw the join come from
    relays_listed: bool = False  # the run lists relays a worker can serve through


def diagnose(facts: NetworkFacts) -> NetworkReport:
    """The findings, most fundamental first: carrier-grade NAT or double NAT before a refused or absent mapping."""
    cgnat = _carrier_grade(facts)
    double = is_private(facts.router_external) and not cgnat
    nat = bool(facts.seen_address) and facts.seen_address != facts.local_address
    findings = []
    if cgnat:
        findings.append(_cgnat_finding(facts))
    if double:
        findings.append(
            Finding(
                what=f"Double NAT: your router's internet side ({facts.router_external}) is itself inside another "
                "router's network (often the provider's box)",
                action=f"Put the provider's box in bridge mode, or forward TCP port {facts.port} on it to "
                f"{facts.router_external}.",
            )
        )
    if nat and not (cgnat or double):  # beyond a second NAT, what the home router does cannot help
        findings.extend(_mapping_findings(facts))
    return NetworkReport(
        local_address=facts.local_address,
        router_external=facts.router_external,
        seen_address=facts.seen_address,
        mapping=facts.mapping,
        mapping_detail=facts.mapping_detail,
        nat=nat or cgnat or double,
        carrier_grade_nat=cgnat,
        double_nat=double,
        findings=findings,
    )


def _carrier_grade(facts: NetworkFacts) -> bool:
    if is_carrier_grade(facts.router_external) or is_carrier_grade(facts.seen_address):
        return True
    # the router holds a public address that is not the one the swarm sees: another NAT beyond it
    return bool(
        facts.router_external
        and facts.seen_address
        and not is_private(facts.router_external)
        and facts.router_external != facts.seen_address
    )


def _cgnat_finding(facts: NetworkFacts) -> Finding:
    shown = facts.router_external or facts.seen_address
    relay = (
        "Nothing at home: the worker serves through one of the swarm's relays."
        if facts.relays_listed
        else "Ask the swarm's operator to run a relay (agora relay) for such workers."
    )
    return Finding(
        what="Carrier-grade NAT: your provider shares one internet address among many customers (your router has "
        f"{shown}"
        + (f", the swarm sees {facts.seen_address})" if facts.seen_address and facts.seen_address != shown else ")")
        + ": no forward on your own router can make this machine reachable",
        action=f"{relay} To serve directly, ask your provider for a public IPv4 address (often called a 'public IP' "
        "or 'IPv4 full stack' option).",
    )


def _mapping_findings(facts: NetworkFacts) -> list[Finding]:
    if facts.mapping == "mapped":
        return []
    forward = f"forward TCP port {facts.port} to {facts.local_address} in your router's settings"
    if facts.mapping == "refused":
        return [
            Finding(
                what=f"Your router refused to open the port: {facts.mapping_detail}",
                action=f"Allow UPnP or NAT-PMP port mapping for this machine in your router's settings, or {forward}.",
            )
        ]
    if facts.mapping == "not offered":
        return [
            Finding(
                what="No router on this network offered automatic port mapping (UPnP or NAT-PMP)",
                action="Turn on UPnP or NAT-PMP in your router's settings (often under 'NAT' or 'Advanced'), or "
                f"{forward}.",
            )
        ]
    return [
        Finding(
            what=f"Automatic port mapping is off ({facts.mapping_detail or '--no-port-mapping'})",
            action=f"Run without --no-port-mapping, or {forward}.",
        )
    ]
