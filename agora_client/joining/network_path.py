"""How the swarm reaches this worker: the router's port mapping, a relay, the address to announce, the diagnosis.

Before the worker's port opens, the client asks the home router to forward it (UPnP or NAT-PMP), unless the user
turned mapping off or announces an address of their own. A forward the router grants is what the worker
announces and what the auth service dials back; one it refuses, or no router at all, is one line, and
the diagnosis after a failed dial-back says what that means and what to do. After a failed dial-back the
router is asked again, and if that brings no forward either, the worker serves through one of the run's
relays (the operator's ``agora relay``) from then on: at once after the first failed dial-back (waiting would
change nothing), after the retry's wait once the relays were tried.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

from agora_client.events import EventWriter, NetworkReport
from agora_client.network import (
    MappingUnavailable,
    NetworkFacts,
    PortMapping,
    diagnose,
    is_carrier_grade,
    is_private,
    local_address_towards,
    tcp_multiaddr,
)
from agora_client.relay import KeptReservation, PeerCredentials, RelayUnavailable


class NetworkPath:
    """The worker's way in from the swarm, from ``open`` (before its port opens) until ``close``."""

    def __init__(
        self,
        port: int,
        swarm_url: str,
        events: EventWriter,
        *,
        port_mapping: bool,
        announce_addr: str | None,
        relays: Sequence[str] = (),
        peer_key: Any = None,
        ticket: Callable[[], str] = str,
    ):
        """``peer_key`` (the worker's libp2p RSA key) signs its relay reserves, which carry the relay pass of the
        last failed dial-back, or ``ticket()`` (the worker's own, "" before admission) once there is one."""
        self.port, self.events = port, events
        self.announce_addr, self.relays = announce_addr, tuple(relays)
        self._credentials = PeerCredentials(peer_key, lambda: ticket() or self._relay_pass) if peer_key else None
        self._relay_pass = ""
        self._relays_tried = False
        self._relay: KeptReservation | None = None
        self.relay, self.relayed_at = "", ""  # the relay in use and the address it holds for this worker
        swarm_host = _host_ip(swarm_url)
        self._off_because = _why_not_map(port_mapping, announce_addr, swarm_host)
        self._mapping: PortMapping | None = None
        self.mapping_state, self.mapping_detail, self.router_external = "off", self._off_because, ""
        self._said_off = False
        self.local_address = local_address_towards(swarm_host)
        self.seen_address = ""

    def open(self) -> bool:
        """Ask the router for a forward of the worker's port (again after a failed dial-back: the user may have
        turned port mapping on meanwhile); True when a new forward came of it. A changed answer is said in one line."""
        if self._off_because:
            if not self._said_off:
                self.events.log(f"Port mapping is off ({self._off_because}).", tag="NETWORK")
                self._said_off = True
            return False
        if self._mapping is not None or self._relay is not None:  # a way in is held already
            return False
        mapping = PortMapping(self.port, on_renewal_failed=self._renewal_failed)
        try:
            mapped = mapping.open()
        except MappingUnavailable as error:
            if str(error) != self.mapping_detail:
                self.events.log(
                    f"Port mapping: {error}; the swarm will try to reach port {self.port} directly.", tag="NETWORK"
                )
            self.router_external = mapping.router_external
            self.mapping_state = "refused" if error.offered else "not offered"
            self.mapping_detail = str(error)
            return False
        self._mapping, self.mapping_state, self.router_external = mapping, "mapped", mapped.external_host
        self.mapping_detail = f"{mapped.external} -> {mapped.internal_host}:{mapped.internal_port}"
        lease = (
            f"lease {mapped.lease_s // 60} min, renewed at half-time" if mapped.lease_s else "until the worker stops"
        )
        self.events.log(
            f"Port mapping: your router forwards {mapped.external} to this machine's port {self.port} "
            f"({mapping.protocol}, {lease}).",
            tag="NETWORK",
        )
        return True

    def use_relay(self, relay_pass: str) -> bool:
        """Serve through the first of the run's relays that holds a port for this worker (after a failed dial-back
        that no port mapping helped, whose answer gave ``relay_pass``); True when one does. A relay that refuses is
        one line."""
        self._relay_pass = relay_pass
        if self._relay is not None:
            return False
        self._relays_tried = True
        for relay in self.relays:
            reservation = KeptReservation(
                relay,
                self.port,
                on_lost=self._relay_lost,
                on_restored=self._relay_restored,
                credentials=self._credentials,
            )
            try:
                self.relayed_at = reservation.open()
            except RelayUnavailable as error:
                self.events.log(f"Relay {relay}: {error}", tag="NETWORK", level="warning")
                continue
            self._relay, self.relay = reservation, relay
            self.events.log(
                f"Serving through the relay {relay}: the swarm reaches this worker at {self.relayed_at}; "
                f"{self.relay_cost()}.",
                tag="NETWORK",
            )
            return True
        return False

    @property
    def relay_untried(self) -> bool:
        """The run lists relays and none has been tried yet."""
        return bool(self.relays) and not self._relays_tried

    def relay_cost(self) -> str:
        """What serving through the relay costs, in words ("" when not relayed)."""
        if self._relay is None:
            return ""
        return (
            f"each request and its answer cross the relay, about {self._relay.rtt_s * 1000:.0f} ms more per round "
            "trip, and the operator's relay carries all of this worker's traffic"
        )

    @property
    def kind(self) -> str:
        """How the swarm reaches the worker once it can (ReachabilityEvent.path)."""
        return "relayed" if self._relay is not None else "mapped" if self._mapping is not None else "direct"

    def describe(self) -> str:
        if self._relay is not None:
            return f"through the relay {self.relay} ({self.relayed_at})"
        if self._mapping is not None:
            return f"through your router's port mapping ({self._mapping.mapped.external})"
        return "directly"

    @property
    def join_port(self) -> int:
        """The port the auth service dials back: the router's forward where there is one."""
        return self._mapping.mapped.external_port if self._mapping is not None else self.port

    @property
    def join_announce(self) -> str | None:
        """The HOST:PORT the join names for the dial-back: the relay's, the user's own, or none (the port only)."""
        return self.relayed_at if self._relay is not None else self.announce_addr

    def announce_maddrs(self) -> list[str]:
        """The addresses the worker announces to the swarm (none: libp2p announces its own)."""
        if self.join_announce is not None:
            return [tcp_multiaddr(self.join_announce)]
        external = self.router_external
        if self._mapping is not None and not is_private(external) and not is_carrier_grade(external):
            return [tcp_multiaddr(self._mapping.mapped.external)]  # a private or shared one helps nobody outside
        return []

    def report(self, seen_address: str = "") -> NetworkReport:
        """The diagnosis, with the address the swarm saw the join come from once known (kept: a join through a
        relay shows the relay's instead)."""
        self.seen_address = seen_address or self.seen_address
        return diagnose(
            NetworkFacts(
                local_address=self.local_address,
                port=self.port,
                mapping=self.mapping_state,
                mapping_detail=self.mapping_detail,
                router_external=self.router_external,
                seen_address=self.seen_address,
                relays_listed=bool(self.relays),
            )
        )

    def close(self) -> None:
        """Remove the router's forward and give the relay's port back (on every stop: the worker no longer listens)."""
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def _relay_lost(self, reason: str) -> None:
        self.events.log(
            f"The relay {self.relay} dropped this worker's port ({reason}): the swarm cannot reach it "
            "until the relay holds it again; reserving it again.",
            tag="NETWORK",
            level="warning",
        )

    def _relay_restored(self, address: str, same: bool) -> None:
        if same:
            self.events.log(
                f"The relay {self.relay} holds this worker's port again: the swarm reaches it at {address}.",
                tag="NETWORK",
            )
            return
        self.events.log(
            f"The relay {self.relay} holds this worker at a new address, {address}, but the swarm knows "
            f"{self.relayed_at}: restart the client to announce the new one.",
            tag="NETWORK",
            level="warning",
        )

    def _renewal_failed(self, reason: str) -> None:
        self.events.log(
            f"Port mapping: renewing the forward failed ({reason}); trying again at the next renewal.",
            tag="NETWORK",
            level="warning",
        )


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
