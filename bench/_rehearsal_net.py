"""The rehearsal's small internet (bench/rehearsal.py): one bridge, the operator's and the trainers' hosts on it,
and homes, each behind a home router of its own (tests/netns_router.py's HomeRouter, its WAN plugged into the
bridge) or, for one, with a public address on the bridge itself.

Addresses: the bridge is ``WAN_SUBNET`` (11.77.0.0/24, public to miniupnpd; it exists only inside these
namespaces, which have no link to the machine's own network), the operator 11.77.0.1, the trainers 11.77.0.2,
home i's router (or the public home itself) 11.77.0.(10+i); a carrier-grade-NAT router's WAN address is
100.64.77.(10+i) on the same bridge, with on-link routes both ways. Each home's uplink and downlink are
shaped with ``tc tbf`` (the home's interface, and the router's LAN side or the bridge's port for the downlink).
Everything is removed by ``close()``: miniupnpd, whatever runs in a namespace, the namespaces with their veths,
qdiscs and nftables tables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tests.netns import Host, _add_bridge, _add_namespace, _delete_namespace, _ip, _plug, _veth
from tests.netns_router import CARRIER_GRADE_NAT_SUBNET, WAN_SUBNET, HomeRouter

ROUTER_KINDS = ("upnp", "cgnat", "public", "natpmp")  # the routers' mix, in the order homes get them: 3 homes, 3 paths
OPERATOR_ADDRESS, TRAINERS_ADDRESS = f"{WAN_SUBNET}.1", f"{WAN_SUBNET}.2"
FIRST_HOME = 10


@dataclass(frozen=True)
class HomeLink:
    """A home's line: its 8b-size speeds and the tiny-size rates the shaping uses."""

    label: str
    up_mbit: float  # what the home's line stands for at the 8b model's traffic
    down_mbit: float
    tiny_up_mbit: float  # the same time per token on tiny's traffic
    tiny_down_mbit: float


class HubRouter(HomeRouter):
    """A HomeRouter whose WAN side is a port of the shared bridge instead of a private internet namespace."""

    def __init__(self, prefix: str, *, kind: str, wan_address: str, hub: str, bridge: str, port: str):
        super().__init__(prefix, mapping="refused" if kind == "cgnat" else "on")
        self.kind, self.wan_address = kind, wan_address
        self._upnp = kind != "natpmp"  # NAT-PMP only: miniupnpd with UPnP off
        self._hub, self._bridge, self._port = hub, bridge, port

    def _build_links(self) -> None:
        for host in (self.router, self.home):
            _add_namespace(host.namespace)
        _veth(self.wan_device, self.router.namespace, self._port, self._hub)
        _ip("-n", self._hub, "link", "set", self._port, "master", self._bridge, "up")
        _veth(self.router.device, self.router.namespace, self.home.device, self.home.namespace)
        for host in (self.router, self.home):
            host.bring_up()
        _ip("-n", self.router.namespace, "addr", "add", f"{self.wan_address}/24", "dev", self.wan_device)
        _ip("-n", self.router.namespace, "link", "set", self.wan_device, "up")
        other = WAN_SUBNET if self.kind == "cgnat" else CARRIER_GRADE_NAT_SUBNET
        _ip("-n", self.router.namespace, "route", "add", f"{other}.0/24", "dev", self.wan_device)
        _ip("-n", self.home.namespace, "route", "add", "default", "via", self.router.address)
        self.router.run("sysctl", "-qw", "net.ipv4.ip_forward=1")

    def shape(self, link: HomeLink) -> None:
        self.home.shape_uplink(link.tiny_up_mbit)
        self.router.shape_uplink(link.tiny_down_mbit)  # the router's LAN side sends what the home downloads


@dataclass
class PublicHome:
    """A home with a public address: a host on the bridge, no router, no NAT."""

    home: Host
    downlink: Host  # the bridge's port towards it: what it sends is the home's downlink
    kind: str = "public"

    def shape(self, link: HomeLink) -> None:
        self.home.shape_uplink(link.tiny_up_mbit)
        self.downlink.shape_uplink(link.tiny_down_mbit)

    def close(self) -> None:
        self.home.remove()


class Internet:
    """The bridge with the operator's and the trainers' hosts; homes are added with ``add_home``."""

    def __init__(self, prefix: str):
        self.prefix, self.tag = prefix, f"{os.getpid() % 100000}"
        self.hub, self.bridge = f"{prefix}-hub", f"r{self.tag}br"
        self.operator = Host(f"{prefix}-op", OPERATOR_ADDRESS, f"r{self.tag}op")
        self.trainers = Host(f"{prefix}-tr", TRAINERS_ADDRESS, f"r{self.tag}tr")
        self.homes: list[HubRouter | PublicHome] = []

    def __enter__(self) -> "Internet":
        try:
            _add_bridge(self.hub, self.bridge)
            for host, port in ((self.operator, f"r{self.tag}po"), (self.trainers, f"r{self.tag}pt")):
                self._attach(host, port)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attach(self, host: Host, port: str) -> None:
        _plug(host, port, self.hub, self.bridge)
        _ip("-n", host.namespace, "route", "add", f"{CARRIER_GRADE_NAT_SUBNET}.0/24", "dev", host.device)

    def add_home(self, index: int, kind: str) -> HubRouter | PublicHome:
        """Home ``index`` behind a router of ``kind`` (one of ROUTER_KINDS); removed with the internet."""
        number, port = FIRST_HOME + index, f"r{self.tag}p{index}"
        if kind == "public":
            host = Host(f"{self.prefix}-h{index}", f"{WAN_SUBNET}.{number}", f"r{self.tag}h{index}")
            home = PublicHome(host, Host(self.hub, "", port))
            self.homes.append(home)
            self._attach(home.home, port)
            _ip("-n", host.namespace, "route", "add", "default", "dev", host.device)  # as its provider's line gives
            return home
        wan = CARRIER_GRADE_NAT_SUBNET if kind == "cgnat" else WAN_SUBNET
        router = HubRouter(
            f"{self.prefix}-{index}",
            kind=kind,
            wan_address=f"{wan}.{number}",
            hub=self.hub,
            bridge=self.bridge,
            port=port,
        )
        self.homes.append(router)
        router.__enter__()
        return router

    def namespaces(self) -> list[str]:
        """Every namespace of this internet, present or not (for the leftovers' count)."""
        names = [self.hub, self.operator.namespace, self.trainers.namespace]
        for home in self.homes:
            hosts = (home.home,) if isinstance(home, PublicHome) else (home.router, home.home)
            names += [host.namespace for host in hosts]
        return names

    def close(self) -> None:
        for home in self.homes:
            home.close()
        for host in (self.operator, self.trainers):
            host.remove()
        _delete_namespace(self.hub)
