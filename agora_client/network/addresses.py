"""Addresses: this machine's own towards another host, and which kinds of address the internet cannot reach."""

from __future__ import annotations

import ipaddress
import socket

CARRIER_GRADE_NAT = ipaddress.ip_network("100.64.0.0/10")


def local_address_towards(host: str) -> str:
    """The local address this machine sends to ``host`` from ("" when it has no route); a UDP connect sends nothing."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return ""


def is_private(address: str) -> bool:
    """A private, loopback or documentation address (Python's list); False for text that is no address."""
    try:
        return ipaddress.ip_address(address).is_private
    except ValueError:
        return False


def is_carrier_grade(address: str) -> bool:
    """In 100.64.0.0/10, the range providers share among customers behind their own NAT."""
    try:
        return ipaddress.ip_address(address) in CARRIER_GRADE_NAT
    except (ValueError, TypeError):
        return False


def tcp_multiaddr(address: str) -> str:
    """A checked ``HOST:PORT`` (``[v6]:PORT`` for IPv6) as the libp2p multiaddr peers dial."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    kind = "ip6" if ":" in host else "ip4" if host.replace(".", "").isdigit() else "dns"
    return f"/{kind}/{host}/tcp/{int(port)}"
