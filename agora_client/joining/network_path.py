"""How the swarm reaches this worker: the router's port mapping, the address to announce, and the diagnosis.

Before the worker's port opens, the client asks the home router to forward it (UPnP), unless the user
turned mapping off or announces an address of their own. A forward the router grants is what the worker
announces and what the auth service dials back; one it refuses, or no router at all, is one line, and
the diagnosis after a failed dial-back says what that means and what to do.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

from agora_client.events import EventWriter, NetworkReport
from agora_client.network import (
    MappingUnavailable, NetworkFacts, PortMapping, diagnose, is_carrier_grade, is_private, local_address_towards,
)


class NetworkPath:
    """The worker's way in from the swarm, from ``open`` (before its port opens) until ``close``."""

    def __init__(self, port: int, swarm_url: str, events: EventWriter, *, port_mapping: bool, announce_addr: str | None):
        self.port, self.events = port, events
        self.announce_addr = announce_addr
        swarm_host = _host_ip(swarm_url)
        self._off_because = _why_not_map(port_mapping, announce_addr, swarm_host)
        self._mapping: PortMapping | None = None
        self.mapping_state, self.mapping_detail, self.router_external = "off", self._off_because, ""
        self._said_off = False
        self.local_address = local_address_towards(swarm_host)

    def open(self) -> bool:
        """Ask the router for a forward of the worker's port (again after a failed dial-back: the user may have
        turned UPnP on meanwhile); True when a new forward came of it. A changed answer is said in one line."""
        if self._off_because:
            if not self._said_off:
                self.events.log(f"Port mapping is off ({self._off_because}).", tag="NETWORK")
                self._said_off = True
            return False
        if self._mapping is not None:
            return False
        mapping = PortMapping(self.port, on_renewal_failed=self._renewal_failed)
        try:
            mapped = mapping.open()
        except MappingUnavailable as error:
            if str(error) != self.mapping_detail:
                self.events.log(f"Port mapping: {error}; the swarm will try to reach port {self.port} directly.",
                                tag="NETWORK")
            self.router_external = mapping.router_external
            self.mapping_state = "refused" if error.offered else "not offered"
            self.mapping_detail = str(error)
            return False
        self._mapping, self.mapping_state, self.router_external = mapping, "mapped", mapped.external_host
        self.mapping_detail = f"{mapped.external} -> {mapped.internal_host}:{mapped.internal_port}"
        lease = f"lease {mapped.lease_s // 60} min, renewed at half-time" if mapped.lease_s else "until the worker stops"
        self.events.log(f"Port mapping: your router forwards {mapped.external} to this machine's port {self.port} "
                        f"(UPnP, {lease}).", tag="NETWORK")
        return True

    @property
    def kind(self) -> str:
        """How the swarm reaches the worker once it can (ReachabilityEvent.path)."""
        return "mapped" if self._mapping is not None else "direct"

    def describe(self) -> str:
        if self._mapping is not None:
            return f"through your router's port mapping ({self._mapping.mapped.external})"
        return "directly"

    @property
    def join_port(self) -> int:
        """The port the auth service dials back: the router's forward where there is one."""
        return self._mapping.mapped.external_port if self._mapping is not None else self.port

    def announce_maddrs(self) -> list[str]:
        """The addresses the worker announces to the swarm (none: libp2p announces its own)."""
        if self.announce_addr is not None:
            return [_maddr(self.announce_addr)]
        if self._mapping is not None and not is_private(self.router_external) and not is_carrier_grade(self.router_external):  # a private one helps nobody outside
            return [_maddr(self._mapping.mapped.external)]
        return []

    def report(self, seen_address: str = "") -> NetworkReport:
        """The diagnosis, with the address the swarm saw the join come from once known."""
        return diagnose(NetworkFacts(
            local_address=self.local_address, port=self.port, mapping=self.mapping_state,
            mapping_detail=self.mapping_detail, router_external=self.router_external, seen_address=seen_address,
        ))

    def close(self) -> None:
        """Remove the router's forward (on every stop: the worker no longer listens there)."""
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def _renewal_failed(self, reason: str) -> None:
        self.events.log(f"Port mapping: renewing the forward failed ({reason}); trying again at the next renewal.",
                        tag="NETWORK", level="warning")


def _why_not_map(wanted: bool, announce_addr: str | None, swarm_host: str) -> str:
    """Why the router is not asked for a forward ("" when it is)."""
    if not wanted:
        return "--no-port-mapping"
    if announce_addr is not None:
        return f"the address {announce_addr} is announced"
    if is_private(swarm_host) or not swarm_host:  # loopback and LAN swarms reach this machine without its router
        return "the swarm is on this machine or its private network: no router stands between them"
    return ""


def _host_ip(url: str) -> str:
    host = urlparse(url).hostname or ""
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except (OSError, IndexError):
        return host


def _maddr(address: str) -> str:
    from agora_client.auth.reachability import parse_announce

    host, port = parse_announce(address)
    kind = "ip6" if ":" in host else "ip4" if host.replace(".", "").isdigit() else "dns"
    return f"/{kind}/{host}/tcp/{port}"
