"""A kernel-level cap on connections per client address for the HTTP services: an nftables table that drops the
SYNs over the cap before they reach accept().

The services' own guard closes every connection over ``max_connections_per_address`` at once, but one address
that reopens them thousands of times a second still costs the service an accept and a close each; the kernel
drops those SYNs for almost nothing. The cap is the guard's own, counted the same way (an IPv4 address, an
IPv6 /64); exempt sources (the host's trusted reverse proxies, which carry every client on one address) are
accepted before the cap. The script replaces the table ``inet agora_guard`` whole, so applying it again is safe.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterable

from agora_client.http_service.limits import ServiceLimits

TABLE = "inet agora_guard"
DEFAULT_CAP = ServiceLimits().max_connections_per_address  # the kernel drops what the guard would close
# Addresses (IPv4) or /64s (IPv6) tracked at once; once full, a new one passes to the guard uncounted.
TRACKED_SOURCES = 65535
NFT_TIMEOUT_S = 30


class FirewallError(RuntimeError):
    """nft is missing, the caller may not change the firewall, or nft refused the script; the message says what to do."""


def render_ruleset(ports: Iterable[int], cap: int = DEFAULT_CAP, exempt: Iterable[str] = ()) -> str:
    """The nftables script capping new TCP connections to ``ports`` at ``cap`` per source, ``exempt`` sources first.

    ValueError for no port, a port out of range, a cap below 1 or an exempt entry that is no address or CIDR range.
    """
    wanted = sorted(set(ports))
    if not wanted or not all(1 <= port <= 65535 for port in wanted):
        raise ValueError(f"ports {wanted}: give at least one TCP port, each 1-65535")
    if cap < 1:
        raise ValueError(f"a connection cap of {cap}: give at least 1")
    dport = "tcp dport { " + ", ".join(str(port) for port in wanted) + " }"
    v4, v6 = _exempt_networks(exempt)
    rules = [f"{dport} ip saddr {{ {', '.join(v4)} }} accept"] if v4 else []
    rules += [f"{dport} ip6 saddr {{ {', '.join(v6)} }} accept"] if v6 else []
    rules += [
        f"{dport} ct state new add @per_address_v4 {{ ip saddr ct count over {cap} }} counter drop",
        f"{dport} ct state new add @per_network_v6 {{ ip6 saddr & ffff:ffff:ffff:ffff:: ct count over {cap} }} counter drop",
    ]
    return "\n".join([
        f"table {TABLE}",  # made (empty) if absent, so that the delete below never fails
        f"delete table {TABLE}",
        f"table {TABLE} {{",
        f"  set per_address_v4 {{ type ipv4_addr; size {TRACKED_SOURCES}; flags dynamic; }}",
        f"  set per_network_v6 {{ type ipv6_addr; size {TRACKED_SOURCES}; flags dynamic; }}",
        "  chain input {",
        "    type filter hook input priority filter; policy accept;",
        *(f"    {rule}" for rule in rules),
        "  }",
        "}",
        "",
    ])


def _exempt_networks(entries: Iterable[str]) -> tuple[list[str], list[str]]:
    """The exempt IPv4 and IPv6 networks, as nft writes them."""
    v4, v6 = [], []
    for entry in entries:
        try:
            network = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ValueError(f"exempt source {entry!r} is not an IP address or CIDR range: "
                             "give e.g. 127.0.0.1 or 10.0.0.0/24") from None
        (v4 if network.version == 4 else v6).append(str(network))
    return v4, v6


def apply_ruleset(script: str) -> None:
    """Load ``script`` into this network namespace's firewall (replacing an earlier ``agora_guard`` table)."""
    _nft(script)


def remove_ruleset() -> None:
    """Delete the ``agora_guard`` table; nothing happens when there is none."""
    _nft(f"table {TABLE}\ndelete table {TABLE}\n")  # made first, so that deleting never fails


def _nft(script: str) -> None:
    """Run ``script`` with ``nft -f -`` in this network namespace."""
    if shutil.which("nft") is None:
        raise FirewallError("nft (nftables) is not installed: install it (apt-get install nftables) and run this again")
    if os.geteuid() != 0:
        raise FirewallError("changing the firewall needs root: run this again with sudo")
    try:
        subprocess.run(["nft", "-f", "-"], input=script, text=True, capture_output=True, check=True, timeout=NFT_TIMEOUT_S)
    except subprocess.CalledProcessError as error:
        raise FirewallError(f"nft refused the ruleset: {error.stderr.strip() or error}; check that the kernel "
                            "has nftables (modprobe nf_tables) and conntrack (nf_conncount)") from None
    except subprocess.TimeoutExpired:
        raise FirewallError(f"nft did not answer within {NFT_TIMEOUT_S} s: check `nft list ruleset` by hand") from None
