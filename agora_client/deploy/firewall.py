"""A kernel-level limit on how fast one client address may open connections to the HTTP services: an nftables
table that drops the SYNs over the limit before they reach accept().

The services' own guard closes every connection over ``max_connections_per_address`` at once, but one address
that reopens them thousands of times a second still costs the service an accept and a close each; the kernel
drops those SYNs for almost nothing. Each address (an IPv6 /64, as the guard counts them) may open ``burst``
connections at once, the guard's own per-address cap, and ``per_minute`` more each minute (50 a second): far above
what a contributor's client, a browser on the public page or a NAT full of contributors opens, far below an
attacker's reconnection loop. A limit on rate, not on connections held: nftables' ``ct count`` kept counting the
attempts it had dropped and shut an address out for many seconds after one burst. Exempt sources (the host's trusted
reverse proxies, which carry every client on one address) are accepted first. The script replaces the table ``inet
agora_guard`` whole, so applying it again is safe.

The sets that hold each address's limit are bounded (``tracked``); a flood of fresh addresses (one IPv6 /48 holds
65,536 /64s) fills them, and an address that finds no room must neither pass unlimited nor be shut out. It is then
limited under a coarser key, its IPv4 /16 or IPv6 /48, at one address's rate: a flood from one block shrinks to one
address's worth, honest newcomers from other blocks each get their own, and those in the flooding block share its
budget, which refills every second, so their SYN retries get through. Sources that find the coarse set full too
(an attacker holding as many /48s as it tracks) share one last limit of that size.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterable

from agora_client.http_service.limits import ServiceLimits

TABLE = "inet agora_guard"
DEFAULT_BURST = ServiceLimits().max_connections_per_address  # an address may open at once what the guard lets it hold
DEFAULT_PER_MINUTE = 3000
TRACKED_SOURCES = 65535  # addresses (IPv4) or /64s (IPv6) tracked at once, and as many /16s or /48s once full
V4_BLOCK, V6_BLOCK = "255.255.0.0", "ffff:ffff:ffff::"  # the coarse keys: an IPv4 /16, an IPv6 /48
V6_NETWORK = "ffff:ffff:ffff:ffff::"  # an IPv6 /64, as the guard counts addresses
FORGET_AFTER_S = 60  # an address's entry, and its limit's state, lasts this long; then it starts with a full burst
NFT_TIMEOUT_S = 30
_SETS = (  # (name, type): each family's sources under their own key, then under their block's
    ("per_address_v4", "ipv4_addr"),
    ("per_block_v4", "ipv4_addr"),
    ("per_network_v6", "ipv6_addr"),
    ("per_block_v6", "ipv6_addr"),
)


class FirewallError(RuntimeError):
    """nft is missing, the caller may not change the firewall, or nft refused the script.

    The message says what to do."""


def render_ruleset(
    ports: Iterable[int],
    per_minute: int = DEFAULT_PER_MINUTE,
    burst: int = DEFAULT_BURST,
    exempt: Iterable[str] = (),
    tracked: int = TRACKED_SOURCES,
) -> str:
    """The nftables script limiting new TCP connections to ``ports`` to ``burst`` at once and ``per_minute`` more
    each minute, per source (``tracked`` of them at once, then per /16 or /48); ``exempt`` sources first.

    ValueError for no port, a port out of range, a rate, burst or set size below 1, or an exempt entry that is no
    address or CIDR range.
    """
    wanted = sorted(set(ports))
    if not wanted or not all(1 <= port <= 65535 for port in wanted):
        raise ValueError(f"ports {wanted}: give at least one TCP port, each 1-65535")
    if min(per_minute, burst, tracked) < 1:
        raise ValueError(
            f"{per_minute} connections a minute, a burst of {burst}, {tracked} tracked sources: give at least 1 of each"
        )
    dport = "tcp dport { " + ", ".join(str(port) for port in wanted) + " }"
    v4, v6 = _exempt_networks(exempt)
    rules = [f"{dport} ip saddr {{ {', '.join(v4)} }} accept"] if v4 else []
    rules += [f"{dport} ip6 saddr {{ {', '.join(v6)} }} accept"] if v6 else []
    limit = f"limit rate over {per_minute}/minute burst {burst} packets"
    new = f"{dport} ct state new"
    rules += _limit_rules(new, "ip saddr", "per_address_v4", f"ip saddr & {V4_BLOCK}", "per_block_v4", limit)
    rules += _limit_rules(
        new, f"ip6 saddr & {V6_NETWORK}", "per_network_v6", f"ip6 saddr & {V6_BLOCK}", "per_block_v6", limit
    )
    sets = f"size {tracked}; flags dynamic,timeout; timeout {FORGET_AFTER_S}s;"
    return "\n".join(
        [
            f"table {TABLE}",  # made (empty) if absent, so that the delete below never fails
            f"delete table {TABLE}",
            f"table {TABLE} {{",
            *(f"  set {name} {{ type {kind}; {sets} }}" for name, kind in _SETS),
            "  chain input {",
            "    type filter hook input priority filter; policy accept;",
            *(f"    {rule}" for rule in rules),
            "  }",
            "}",
            "",
        ]
    )


def _limit_rules(new: str, fine_key: str, fine: str, coarse_key: str, coarse: str, limit: str) -> list[str]:
    """A source's limit under ``fine_key`` in the set ``fine``; a source that found ``fine`` full (an add to a full
    set does not match, so the packet goes on) under ``coarse_key`` in ``coarse``; one that found both full, under
    one limit shared by all such."""
    return [
        f"{new} add @{fine} {{ {fine_key} {limit} }} counter drop",
        f"{new} {fine_key} != @{fine} add @{coarse} {{ {coarse_key} {limit} }} counter drop",
        f"{new} {fine_key} != @{fine} {coarse_key} != @{coarse} {limit} counter drop",
    ]


def _exempt_networks(entries: Iterable[str]) -> tuple[list[str], list[str]]:
    """The exempt IPv4 and IPv6 networks, as nft writes them."""
    v4, v6 = [], []
    for entry in entries:
        try:
            network = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise ValueError(
                f"exempt source {entry!r} is not an IP address or CIDR range: give e.g. 127.0.0.1 or 10.0.0.0/24"
            ) from None
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
        subprocess.run(
            ["nft", "-f", "-"], input=script, text=True, capture_output=True, check=True, timeout=NFT_TIMEOUT_S
        )
    except subprocess.CalledProcessError as error:
        raise FirewallError(
            f"nft refused the ruleset: {error.stderr.strip() or error}; check that the kernel "
            "has nftables (modprobe nf_tables) and conntrack (nf_conncount)"
        ) from None
    except subprocess.TimeoutExpired:
        raise FirewallError(f"nft did not answer within {NFT_TIMEOUT_S} s: check `nft list ruleset` by hand") from None
