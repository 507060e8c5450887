"""The home router's NAT-PMP (RFC 6886, through ``py-natpmp``): the default gateway, asked over UDP port 5351.

Routers without UPnP often speak NAT-PMP (Apple's, many OpenWrt and ISP boxes), and those that speak its
successor PCP answer NAT-PMP requests too (RFC 6887 section 9 keeps it; miniupnpd does). Unlike UPnP, the
router picks the external port itself, from the one asked for, and says which.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from natpmp import NATPMP

from agora_client.network.addresses import local_address_towards
from agora_client.network.mapped_port import MappedPort, MappingUnavailable

ROUTES = Path("/proc/thread-self/net/route")  # this thread's network namespace, not the process's
TRIES = 3  # 0.25 + 0.5 + 1 s: the specification's nine tries would wait two minutes for a router that is not there
GATEWAY_FLAG = 0x2  # RTF_GATEWAY


def default_gateway(routes: Path = ROUTES) -> str:
    """The IPv4 default route's gateway ("" when there is none, or the system keeps no /proc/net/route)."""
    try:
        lines = routes.read_text().splitlines()[1:]
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[1] == "00000000" and int(fields[3], 16) & GATEWAY_FLAG:
            return socket.inet_ntoa(struct.pack("<I", int(fields[2], 16)))
    return ""


class NatPmpGateway:
    """The default gateway's NAT-PMP; ``find`` first, then ``add``/``renew``/``remove``."""

    protocol = "NAT-PMP"

    def __init__(self, gateway: str | None = None):
        self.gateway = gateway or ""  # found in ``find``: the default route as the calling thread sees it
        self.router_external = ""

    def find(self) -> None:
        """Ask the gateway for its internet address; raises MappingUnavailable when it does not speak NAT-PMP or
        cannot map (behind carrier-grade NAT, miniupnpd answers "network failure")."""
        self.gateway = self.gateway or default_gateway()
        if not self.gateway:
            raise MappingUnavailable("this machine has no default gateway to ask over NAT-PMP", offered=False)
        self.router_external = self._ask(
            lambda: NATPMP.get_public_address(self.gateway, retry=TRIES), "say its internet address"
        )

    def add(self, port: int, lease_s: int) -> MappedPort:
        """Forward an external port (``port`` if the router can) to this machine's ``port``."""
        return self.renew(MappedPort(self.router_external, port, local_address_towards(self.gateway), port, lease_s))

    def renew(self, wanted: MappedPort) -> MappedPort:
        granted = self._ask(
            lambda: NATPMP.map_tcp_port(
                wanted.external_port,
                wanted.internal_port,
                wanted.lease_s,
                gateway_ip=self.gateway,
                retry=TRIES,
            ),
            f"forward TCP port {wanted.external_port} to this machine",
        )
        return MappedPort(
            wanted.external_host, granted.public_port, wanted.internal_host, wanted.internal_port, granted.lifetime
        )

    def remove(self, mapped: MappedPort) -> None:
        try:  # lifetime 0 and external port 0 delete the mapping of that internal port (RFC 6886 3.4)
            NATPMP.map_tcp_port(0, mapped.internal_port, 0, gateway_ip=self.gateway, retry=TRIES)
        except (NATPMP.NATPMPError, OSError):  # the lease ends the forward anyway
            pass

    def _ask(self, request, what: str):
        try:
            return request()
        except NATPMP.NATPMPResultError as refusal:
            words = " ".join(refusal.args[1].split())  # py-natpmp's texts hold double spaces
            raise MappingUnavailable(f"the router refused to {what} over NAT-PMP ({words})", offered=True) from None
        except (NATPMP.NATPMPError, OSError):
            raise MappingUnavailable(f"the gateway {self.gateway} did not answer NAT-PMP", offered=False) from None
