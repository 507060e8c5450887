"""A TCP port mapping on the home router (UPnP IGD, else NAT-PMP): asked for, renewed, removed.

The worker's libp2p port must accept connections from the swarm. Behind a home router that needs a
port forward; most routers grant one on request. ``PortMapping.open`` asks the router over UPnP
(``upnp_gateway.py``) and, where UPnP is absent or refuses, over NAT-PMP (``natpmp_gateway.py``); a
thread renews the lease at half-time, and ``close`` removes the forward, so that a worker that stops,
Ctrl-C included, leaves none behind (a killed one leaves it for at most one lease).

libp2p's own mapping (``nat_port_map``) stays off (``engine.LIBP2P_PORT_MAPPING``): it reports
nothing, so the client could neither say whether it worked nor announce the mapped address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from agora_client.network.mapped_port import MappedPort, MappingUnavailable
from agora_client.network.natpmp_gateway import NatPmpGateway
from agora_client.network.upnp_gateway import UpnpGateway

DEFAULT_LEASE_S = 3600  # a killed worker's forward disappears within this; renewed at half-time


class Gateway(Protocol):
    protocol: str
    router_external: str

    def find(self) -> None: ...
    def add(self, port: int, lease_s: int) -> MappedPort: ...
    def renew(self, wanted: MappedPort) -> MappedPort: ...
    def remove(self, mapped: MappedPort) -> None: ...


class PortMapping:
    """One TCP port forward on the home router, held from ``open`` until ``close``."""

    def __init__(
        self,
        port: int,
        on_renewal_failed: Callable[[str], None],
        lease_s: int = DEFAULT_LEASE_S,
        gateways: Sequence[Gateway] | None = None,
    ):
        self.port, self.lease_s, self.on_renewal_failed = port, lease_s, on_renewal_failed
        self._gateways = list(gateways) if gateways is not None else [UpnpGateway(), NatPmpGateway()]
        self._lock = threading.Lock()  # the renewal thread and close share one router client
        self._closed = threading.Event()
        self._renewal: threading.Thread | None = None
        self._gateway: Gateway | None = None
        self.mapped: MappedPort | None = None
        self.router_external = ""  # the router's internet address as it says, known once it answered

    @property
    def protocol(self) -> str:
        """How the router was asked ("UPnP" or "NAT-PMP"; "" before a forward)."""
        return self._gateway.protocol if self._gateway is not None else ""

    def open(self) -> MappedPort:
        """Ask the router to forward an external port to this machine's ``port``; raises MappingUnavailable, saying
        what each protocol answered, when none forwards it."""
        refusals: list[MappingUnavailable] = []
        with self._lock:
            for gateway in self._gateways:
                try:
                    gateway.find()
                    self.mapped, self._gateway = gateway.add(self.port, self.lease_s), gateway
                    break
                except MappingUnavailable as refusal:
                    refusals.append(refusal)
                finally:
                    self.router_external = self.router_external or gateway.router_external
            else:
                raise _combined(refusals)
        if self.mapped.lease_s:
            self._renewal = threading.Thread(target=self._renew_until_closed, name="port-mapping-renewal", daemon=True)
            self._renewal.start()
        return self.mapped

    def close(self) -> None:
        """Remove the forward (once; a router that does not answer keeps it until its lease ends)."""
        self._closed.set()
        if self._renewal is not None:
            self._renewal.join()
        with self._lock:
            if self.mapped is None:
                return
            self._gateway.remove(self.mapped)
            self.mapped = None

    def _renew_until_closed(self) -> None:
        mapped = self.mapped
        while not self._closed.wait(mapped.lease_s / 2):
            with self._lock:
                try:
                    self._gateway.renew(mapped)
                except MappingUnavailable as refusal:
                    self.on_renewal_failed(str(refusal))  # the forward lasts until its lease ends: the next one may do


def _combined(refusals: Sequence[MappingUnavailable]) -> MappingUnavailable:
    """One refusal for all protocols: what the routers that answered said, or that none did."""
    answered = [refusal for refusal in refusals if refusal.offered]
    if not answered:
        return MappingUnavailable(
            "no router on this network answered a UPnP search or a NAT-PMP request", offered=False
        )
    return MappingUnavailable("; ".join(str(refusal) for refusal in answered), offered=True)
