"""A TCP port mapping on the home router (UPnP IGD through ``miniupnpc``): asked for, renewed, removed.

The worker's libp2p port must accept connections from the swarm. Behind a home router that needs a
port forward; most routers grant one on request (UPnP IGD). ``PortMapping.open`` asks the router for
one, a thread renews its lease at half-time, and ``close`` removes it, so that a worker that stops,
Ctrl-C included, leaves no forward behind (a killed one leaves it for at most one lease).

libp2p's own mapping (``nat_port_map``) stays off (``engine.LIBP2P_PORT_MAPPING``): it reports
nothing, so the client could neither say whether it worked nor announce the mapped address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import miniupnpc

DEFAULT_LEASE_S = 3600  # a killed worker's forward disappears within this; renewed at half-time
DISCOVERY_MS = 1000  # how long to wait for routers to answer the SSDP search (miniupnpc searches a few times)
DESCRIPTION = "Agora worker"
PERMANENT_ONLY = "OnlyPermanentLeasesSupported"  # UPnP error 725: some routers take only leases without an end
TAKEN = "ConflictInMappingEntry"  # UPnP error 718: another machine of the home holds that external port
EXTERNAL_PORT_TRIES = 8  # two machines of one home both run a worker on the default port: the second takes the next


class MappingUnavailable(Exception):
    """No mapping: no router offered UPnP, or it refused (the message says which, in the router's words)."""

    def __init__(self, reason: str, offered: bool):
        super().__init__(reason)
        self.offered = offered  # a router answered: it refused rather than being absent


@dataclass(frozen=True)
class MappedPort:
    """Where the swarm reaches the worker through the router: ``external_host:external_port`` -> the local port."""

    external_host: str
    external_port: int
    internal_host: str
    internal_port: int
    lease_s: int  # 0: the router keeps it until it is removed

    @property
    def external(self) -> str:
        return f"{self.external_host}:{self.external_port}"


class PortMapping:
    """One TCP port forward on the router's UPnP IGD, held from ``open`` until ``close``."""

    def __init__(
        self, port: int, on_renewal_failed: Callable[[str], None], lease_s: int = DEFAULT_LEASE_S,
        discovery_ms: int = DISCOVERY_MS,
    ):
        self.port, self.lease_s, self.on_renewal_failed = port, lease_s, on_renewal_failed
        self._upnp = miniupnpc.UPnP()
        self._upnp.discoverdelay = discovery_ms
        self._lock = threading.Lock()  # the renewal thread and close share one UPnP client
        self._closed = threading.Event()
        self._renewal: threading.Thread | None = None
        self.mapped: MappedPort | None = None
        self.router_external = ""  # the router's internet address as it says, known once it answered

    def open(self) -> MappedPort:
        """Find the router and forward its external ``port`` to this machine's; raises MappingUnavailable."""
        with self._lock:
            self._find_router()
            self.router_external = self._external_address()
            self.mapped = self._add_first_free(self.router_external)
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
            try:
                self._upnp.deleteportmapping(self.mapped.external_port, "TCP")
            except Exception:  # miniupnpc raises plain Exceptions; the lease ends the forward anyway
                pass
            self.mapped = None

    def _find_router(self) -> None:
        try:
            found = self._upnp.discover()
        except Exception:  # miniupnpc raises when no device answers (its text then says "Success")
            found = 0
        if not found:
            raise MappingUnavailable("no router on this network answered a UPnP search", offered=False)
        try:
            self._upnp.selectigd()
        except Exception as error:
            raise MappingUnavailable(f"no UPnP device here is an internet gateway ({error})", offered=False) from None

    def _external_address(self) -> str:
        """The router's own internet address ("" where it will not say: miniupnpd names no private or shared one)."""
        try:
            return self._upnp.externalipaddress()
        except Exception:
            return ""

    def _add_first_free(self, external_host: str) -> MappedPort:
        """The forward from the first external port no other machine of the home holds, from the local one up."""
        *first_tries, last_try = range(self.port, self.port + EXTERNAL_PORT_TRIES)
        for external_port in first_tries:
            try:
                return self._mapped(external_host, external_port)
            except MappingUnavailable as refusal:
                if TAKEN not in str(refusal):
                    raise
        return self._mapped(external_host, last_try)

    def _mapped(self, external_host: str, external_port: int) -> MappedPort:
        lease_s = self._add(external_port, self.lease_s)
        return MappedPort(external_host, external_port, self._upnp.lanaddr, self.port, lease_s)

    def _add(self, external_port: int, lease_s: int) -> int:
        """Ask for the forward; the lease granted (0 where the router takes only permanent ones)."""
        try:
            self._upnp.addportmapping(external_port, "TCP", self._upnp.lanaddr, self.port, DESCRIPTION, "", lease_s)
            return lease_s
        except Exception as error:  # miniupnpc raises plain Exceptions holding the router's UPnP error
            if lease_s and PERMANENT_ONLY in str(error):
                return self._add(external_port, 0)
            raise MappingUnavailable(
                f"the router refused to forward TCP port {external_port} to this machine ({error})", offered=True,
            ) from None

    def _renew_until_closed(self) -> None:
        mapped = self.mapped
        while not self._closed.wait(mapped.lease_s / 2):
            with self._lock:
                try:
                    self._add(mapped.external_port, mapped.lease_s)
                except MappingUnavailable as refusal:  # the next renewal tries again; the forward lasts until the lease ends
                    self.on_renewal_failed(str(refusal))
