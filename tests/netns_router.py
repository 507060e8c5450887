"""A home router on one machine: three network namespaces and a real miniupnpd, for tests of UPnP port mapping.

::

    with HomeRouter("agi30-1234") as net:            # agi30-1234-inet / -rtr / -home
        with net.home.entered():                     # the contributor, on the router's LAN
            ...                                      # miniupnpc finds the router's IGD and maps a port
        with net.internet.entered():                 # the swarm side dials net.wan_address:<mapped port>
            ...
        net.mappings()                               # the router's port mappings, as miniupnpd records them

- ``internet`` (``<prefix>-inet``): one address on the WAN link, nothing else;
- ``router`` (``<prefix>-rtr``): a WAN veth towards internet and a LAN veth towards home, IPv4 forwarding, an
  nftables firewall of a home router (LAN to WAN masqueraded, nothing forwarded inwards unless mapped) and
  ``miniupnpd`` (Debian's miniupnpd-nftables) in the foreground, answering UPnP IGD and NAT-PMP on the LAN only;
- ``home`` (``<prefix>-home``): on ``LAN_SUBNET``, default route via the router (which also carries miniupnpc's
  SSDP multicast search: no multicast route is needed).

miniupnpd 2.3.1 maps nothing while its WAN address is private or reserved (it has no option to allow that:
``ext_ip`` must be public too, and ``ext_perform_stun`` needs a public answer), so with ``mapping="on"`` the WAN
link uses ``WAN_SUBNET``, a public block (11.0.0.0/8, which miniupnpd's own tests treat as public). Network
rule: such an address exists only inside these namespaces, which have no link to the machine's own namespace
or any other; only the namespaces made here may send traffic to it, and nothing in the machine's own
namespace ever dials it. ``mapping="refused"`` is the carrier-grade-NAT case: the WAN address lies in
100.64.0.0/10, and miniupnpd refuses every mapping ("Reserved / private IP address ... Port forwarding is
impossible" in ``router_log()``; miniupnpc's AddPortMapping raises ``Exception('Action Failed')`` and its
externalipaddress() returns '').

Everything made here is removed on exit, even on failure: miniupnpd is stopped, whatever still runs in a
namespace is killed, the namespaces (with their veths and nftables tables) are deleted and miniupnpd's
config, lease and log files (a temporary folder) removed. Needs root, ``ip``, ``nft`` and ``miniupnpd``
built for nftables; ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.netns import Host, _add_namespace, _ip, _veth
from tests.netns import unavailable as namespaces_unavailable

LAN_SUBNET = "192.168.77"
WAN_SUBNET = "11.77.0"  # public to miniupnpd: see the module docstring for where it may be used
CARRIER_GRADE_NAT_SUBNET = "100.64.77"  # RFC 6598 shared space: miniupnpd refuses to map behind it
MAPPINGS = ("on", "refused")
MINIUPNPD_START_S = 10.0
MINIUPNPD_STOP_S = 5.0
# miniupnpd's last start-up line: UPnP (SSDP and HTTP) is listening by then
MINIUPNPD_READY = "Listening for NAT-PMP/PCP traffic"


def unavailable() -> str | None:
    """Why the home router cannot be built here (None when it can)."""
    reason = namespaces_unavailable(firewall=True)
    if reason:
        return reason
    if shutil.which("miniupnpd") is None:
        return "miniupnpd is not installed: DEBIAN_FRONTEND=noninteractive apt-get install -y miniupnpd-nftables"
    version = subprocess.run(["miniupnpd", "--version"], capture_output=True, text=True, timeout=30)
    if "nftables" not in version.stdout + version.stderr:
        return "miniupnpd is not the nftables build: apt-get install miniupnpd-nftables"
    return None


@dataclass(frozen=True)
class Mapping:
    """One port mapping as miniupnpd's lease file records it (rewritten on each add, delete and expiry)."""

    protocol: str
    external_port: int
    internal_address: str
    internal_port: int
    expires_at: int  # Unix time
    description: str


def _parse_lease(line: str) -> Mapping:
    protocol, external_port, address, internal_port, expires_at, description = line.split(":", 5)
    return Mapping(protocol, int(external_port), address, int(internal_port), int(expires_at), description)


class HomeRouter:
    """Namespaces ``<prefix>-inet``, ``<prefix>-rtr`` and ``<prefix>-home``: a home LAN behind a UPnP router."""

    def __init__(self, prefix: str, *, mapping: str = "on"):
        if mapping not in MAPPINGS:
            raise ValueError(f"mapping={mapping!r}: use one of {MAPPINGS}")
        tag = f"u{prefix[-7:]}"  # at most 15 characters with a suffix; a letter first, or miniupnpd reads an address
        wan = WAN_SUBNET if mapping == "on" else CARRIER_GRADE_NAT_SUBNET
        self.wan_address, self.wan_device = f"{wan}.1", f"{tag}w"
        self.internet = Host(f"{prefix}-inet", f"{wan}.2", f"{tag}i")
        self.router = Host(f"{prefix}-rtr", f"{LAN_SUBNET}.1", f"{tag}l")  # its LAN side; the WAN side is wan_*
        self.home = Host(f"{prefix}-home", f"{LAN_SUBNET}.2", f"{tag}h")
        self._files: Path | None = None
        self._daemon: subprocess.Popen | None = None
        self._allow_lan = True  # the config's rules: the LAN may map its own ports, or nobody may map anything
        self._upnp = True  # UPnP answers beside NAT-PMP (off: a router that speaks NAT-PMP only)

    def __enter__(self) -> "HomeRouter":
        try:
            self._build_links()
            self._build_firewall()
            self._start_miniupnpd()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build_links(self) -> None:
        for host in (self.internet, self.router, self.home):
            _add_namespace(host.namespace)
        _veth(self.wan_device, self.router.namespace, self.internet.device, self.internet.namespace)
        _veth(self.router.device, self.router.namespace, self.home.device, self.home.namespace)
        for host in (self.internet, self.router, self.home):
            host.bring_up()
        _ip("-n", self.router.namespace, "addr", "add", f"{self.wan_address}/24", "dev", self.wan_device)
        _ip("-n", self.router.namespace, "link", "set", self.wan_device, "up")
        _ip("-n", self.home.namespace, "route", "add", "default", "via", self.router.address)
        self.router.run("sysctl", "-qw", "net.ipv4.ip_forward=1")

    def _build_firewall(self) -> None:
        """A home router's rules, with the empty chains miniupnpd fills (its defaults: table inet filter); like most
        home routers it drops, rather than refuses, what the internet side opens towards itself."""
        ruleset = f"""
table inet filter {{
    chain forward {{
        type filter hook forward priority 0; policy drop;
        jump miniupnpd
        ct state established,related accept
        iifname "{self.router.device}" oifname "{self.wan_device}" accept
    }}
    chain miniupnpd {{ }}
    chain input {{
        type filter hook input priority 0; policy accept;
        iifname "{self.wan_device}" ct state new drop
    }}
    chain prerouting {{
        type nat hook prerouting priority -100; policy accept;
        jump prerouting_miniupnpd
    }}
    chain postrouting {{
        type nat hook postrouting priority 100; policy accept;
        jump postrouting_miniupnpd
        ip saddr {LAN_SUBNET}.0/24 oifname "{self.wan_device}" masquerade
    }}
    chain prerouting_miniupnpd {{ }}
    chain postrouting_miniupnpd {{ }}
}}
"""
        subprocess.run(
            ["ip", "netns", "exec", self.router.namespace, "nft", "-f", "-"],
            input=ruleset,
            text=True,
            check=True,
            capture_output=True,
            timeout=30,
        )

    def _miniupnpd_config(self) -> str:
        return "\n".join(
            [
                f"ext_ifname={self.wan_device}",
                f"listening_ip={self.router.device}",
                "http_port=0",  # any free port: the SSDP answer names it
                f"enable_upnp={'yes' if self._upnp else 'no'}",
                "enable_natpmp=yes",
                "ipv6_disable=yes",
                "secure_mode=yes",  # a client maps ports to its own address only, like a home router
                f"lease_file={self._files / 'leases'}",
                f"minissdpdsocket={self._files / 'minissdpd.sock'}",  # never a system minissdpd
                f"uuid={uuid.uuid4()}",
                *([f"allow 1024-65535 {LAN_SUBNET}.0/24 1024-65535"] if self._allow_lan else []),
                "deny 0-65535 0.0.0.0/0 0-65535",
                "",
            ]
        )

    @contextmanager
    def blocked(self, address: str, port: int) -> Iterator[None]:
        """The router turns away what the home sends to ``address:port`` (a firewall between home and one service)."""
        table = f"agora_block_{port}"
        self.router.run("nft", "add", "table", "inet", table)
        try:
            self.router.run(
                "nft",
                "add",
                "chain",
                "inet",
                table,
                "forward",
                "{ type filter hook forward priority -10; policy accept; }",
            )
            self.router.run(
                "nft",
                "add",
                "rule",
                "inet",
                table,
                "forward",
                "ip",
                "daddr",
                address,
                "tcp",
                "dport",
                str(port),
                "reject",
                "with",
                "tcp",
                "reset",
            )
            yield
        finally:
            self.router.run("nft", "delete", "table", "inet", table, check=False)

    def switch_upnp(self, state: str) -> None:
        """Restart the router's port mapping as ``state``: "on" (the LAN maps its ports over UPnP and NAT-PMP),
        "natpmp" (over NAT-PMP only: UPnP is off), "denied" (the config refuses every mapping) or "off" (no
        miniupnpd: nothing answers a search)."""
        if state not in ("on", "natpmp", "denied", "off"):
            raise ValueError(f"state={state!r}: use on, natpmp, denied or off")
        self._stop_miniupnpd()
        self._allow_lan, self._upnp = state in ("on", "natpmp"), state != "natpmp"
        if state != "off":
            self._start_miniupnpd()

    def _start_miniupnpd(self) -> None:
        self._files = self._files or Path(tempfile.mkdtemp(prefix="agora-miniupnpd-"))
        config = self._files / "miniupnpd.conf"
        config.write_text(self._miniupnpd_config())
        with open(self._files / "miniupnpd.log", "wb") as log:
            self._daemon = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.router.namespace,
                    "miniupnpd",
                    "-d",
                    "-f",
                    str(config),
                    "-P",
                    str(self._files / "miniupnpd.pid"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + MINIUPNPD_START_S
        while MINIUPNPD_READY not in self.router_log():
            if self._daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"miniupnpd did not start in {self.router.namespace}:\n{self.router_log()}")
            time.sleep(0.05)

    def router_log(self) -> str:
        """What miniupnpd said so far (-d: every message, debug included)."""
        return (self._files / "miniupnpd.log").read_text(errors="replace")

    def mappings(self) -> list[Mapping]:
        """The router's current port mappings (UPnP and NAT-PMP alike), oldest first."""
        leases = self._files / "leases"
        lines = leases.read_text().splitlines() if leases.exists() else []  # no file before the first mapping
        return [_parse_lease(line) for line in lines if line]

    def _stop_miniupnpd(self) -> None:
        if self._daemon is None:
            return
        self._daemon.terminate()  # ip netns exec became miniupnpd itself: this reaches the daemon
        try:
            self._daemon.wait(timeout=MINIUPNPD_STOP_S)
        except subprocess.TimeoutExpired:
            self._daemon.kill()
            self._daemon.wait(timeout=MINIUPNPD_STOP_S)
        self._daemon = None

    def close(self) -> None:
        try:
            self._stop_miniupnpd()
        finally:
            for host in (self.home, self.router, self.internet):
                host.remove()  # kills what still runs there; the veths and nftables tables go with the namespace
            if self._files is not None:
                shutil.rmtree(self._files, ignore_errors=True)
