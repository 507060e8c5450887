"""The home router's UPnP IGD (through ``miniupnpc``): found by an SSDP search, asked for TCP forwards."""

from __future__ import annotations

import miniupnpc

from agora_client.network.mapped_port import DESCRIPTION, MappedPort, MappingUnavailable

DISCOVERY_MS = 1000  # how long to wait for routers to answer the SSDP search (miniupnpc searches a few times)
PERMANENT_ONLY = "OnlyPermanentLeasesSupported"  # UPnP error 725: some routers take only leases without an end
TAKEN = "ConflictInMappingEntry"  # UPnP error 718: another machine of the home holds that external port
EXTERNAL_PORT_TRIES = 8  # two machines of one home both run a worker on the default port: the second takes the next


class UpnpGateway:
    """One router's UPnP IGD; ``find`` first, then ``add``/``remove`` (not thread-safe: PortMapping serialises)."""

    protocol = "UPnP"

    def __init__(self, discovery_ms: int = DISCOVERY_MS):
        self._upnp = miniupnpc.UPnP()
        self._upnp.discoverdelay = discovery_ms
        self.router_external = ""  # the router's internet address as it says, known once it answered

    def find(self) -> None:
        """Search the LAN for an internet gateway; raises MappingUnavailable (not offered) when none answers."""
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
        self.router_external = self._external_address()

    def add(self, port: int, lease_s: int) -> MappedPort:
        """Forward the first external port no other machine of the home holds, from ``port`` up."""
        *first_tries, last_try = range(port, port + EXTERNAL_PORT_TRIES)
        for external_port in first_tries:
            try:
                return self.renew(MappedPort(self.router_external, external_port, self._upnp.lanaddr, port, lease_s))
            except MappingUnavailable as refusal:
                if TAKEN not in str(refusal):
                    raise
        return self.renew(MappedPort(self.router_external, last_try, self._upnp.lanaddr, port, lease_s))

    def renew(self, wanted: MappedPort) -> MappedPort:
        """Ask for ``wanted`` (again); what the router granted (lease 0 where it takes only permanent ones)."""
        try:
            self._add(wanted, wanted.lease_s)
            return wanted
        except MappingUnavailable as refusal:
            if not (wanted.lease_s and PERMANENT_ONLY in str(refusal)):
                raise
        self._add(wanted, 0)
        return MappedPort(wanted.external_host, wanted.external_port, wanted.internal_host, wanted.internal_port, 0)

    def remove(self, mapped: MappedPort) -> None:
        try:
            self._upnp.deleteportmapping(mapped.external_port, "TCP")
        except Exception:  # miniupnpc raises plain Exceptions; the lease ends the forward anyway
            pass

    def _add(self, wanted: MappedPort, lease_s: int) -> None:
        try:
            self._upnp.addportmapping(
                wanted.external_port, "TCP", wanted.internal_host, wanted.internal_port, DESCRIPTION, "", lease_s
            )
        except Exception as error:  # miniupnpc raises plain Exceptions holding the router's UPnP error
            raise MappingUnavailable(
                f"the router refused to forward TCP port {wanted.external_port} to this machine ({error})",
                offered=True,
            ) from None

    def _external_address(self) -> str:
        """The router's own internet address ("" where it will not say: miniupnpd names no private or shared one)."""
        try:
            return self._upnp.externalipaddress()
        except Exception:
            return ""
