"""The client's address behind reverse proxies: ``X-Forwarded-For`` believed only from the proxies the operator trusts.

Each proxy appends the address it got the request from, so the header is read from its right end: while the hop
at hand is a trusted proxy, the address it wrote is the hop before it. The first hop that is not a trusted proxy
is the client. Anything further left was written by that client, and so is never believed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class TrustedProxies:
    """The reverse proxies whose ``X-Forwarded-For`` the service believes; none by default."""

    def __init__(self, networks: Iterable[IpNetwork] = ()):
        self.networks = tuple(networks)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> "TrustedProxies":
        """From addresses or CIDR ranges as the operator gives them (``--trusted-proxy``).

        ValueError says which is wrong."""
        networks = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                raise ValueError(
                    f"--trusted-proxy {entry!r} is not an IP address or CIDR range: give the proxy's address as the "
                    "service sees it, e.g. 127.0.0.1 or 10.0.0.0/24"
                ) from None
        return cls(networks)

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __contains__(self, address: str) -> bool:
        parsed = _ip(address)
        return parsed is not None and any(parsed in network for network in self.networks)

    def client_address(self, peer: str, forwarded_for: Iterable[str]) -> str:
        """Who sent the request: ``peer`` (the TCP peer), or while that is a trusted proxy, the hop it names.

        ``forwarded_for`` holds the request's ``X-Forwarded-For`` headers in the order they came.
        """
        address = peer
        hops = [hop for header in forwarded_for for hop in header.split(",")]
        while hops and address in self:
            hop = _ip(hops.pop())
            if hop is None:  # a trusted proxy passed on something that is no address: believe nothing further
                break
            address = str(hop)
        return address


NO_TRUSTED_PROXIES = TrustedProxies()


def _ip(text: str) -> IpAddress | None:
    """The address in ``text`` (an IPv4-mapped IPv6 address as IPv4; a port some proxies add is dropped)."""
    text = text.strip()
    for candidate in (
        text,
        text.rpartition(":")[0] if text.count(":") == 1 else "",
        text.partition("]")[0].lstrip("["),
    ):
        try:
            parsed = ipaddress.ip_address(candidate)
        except ValueError:
            continue
        mapped = getattr(parsed, "ipv4_mapped", None)
        return mapped if mapped is not None else parsed
    return None
