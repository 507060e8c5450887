"""Separate hosts on one machine: Linux network namespaces joined by veth pairs (no loopback shortcut).

For tests and benches that need real separate hosts::

    with TwoHosts("agi11-1234") as hosts:          # namespaces agi11-1234-a / -b, 10.77.0.1 <-> 10.77.0.2
        with hosts.a.entered():                    # sockets and child processes made here live in host a
            server = start_something(host=hosts.a.address)
        with hosts.b.drop_inbound_tcp(port):       # host b's firewall drops new connections to that port
            ...

``entered()`` switches only the calling thread's network namespace (setns), so a server socket or a
``subprocess.Popen`` made inside it belongs to that host, while the rest of the test stays outside.
Everything made here is removed on exit, even on failure: processes still running in a namespace are
killed, the namespaces (and with them the veth pair and any nftables rules) deleted. Needs root, ``ip``
(iproute2) and, for firewall rules, ``nft`` (nftables); ``unavailable()`` says why not, for a skip.

More than two hosts, each with an uplink that may be shaped like a home link::

    with BridgedHosts("agi15-1234", 3) as hosts:   # agi15-1234-h0..h2 on 10.78.0.1..3, a bridge in agi15-1234-hub
        hosts[1].shape_uplink(20.0)                # host 1 sends at most 20 Mbit/s (tc tbf on its interface)

Every host's veth ends in a bridge that lives in a namespace of its own, so nothing is added to the
machine's own network namespace; deleting the namespaces removes the veths, the bridge and the qdiscs.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
SUBNET = "10.77.0"
BRIDGED_SUBNET = "10.78.0"
# tbf needs a bucket of at least one packet; veth hands it segmentation-offloaded packets of up to 64 KiB
TBF_MIN_BURST_BYTES = 64 * 1024
TBF_LATENCY = "200ms"  # queue depth of the shaped link, like a home router's buffer


def unavailable(firewall: bool = False, shaping: bool = False) -> str | None:
    """Why namespace tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if firewall and shutil.which("nft") is None:
        return "nft (nftables) is not installed: apt-get install nftables"
    if shaping and shutil.which("tc") is None:
        return "the tc command (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _add_namespace(namespace: str) -> None:
    _ip("netns", "add", namespace)
    _ip("-n", namespace, "link", "set", "lo", "up")


def _veth(device: str, namespace: str, peer: str, peer_namespace: str) -> None:
    """A veth pair: ``device`` in ``namespace``, its other end ``peer`` in ``peer_namespace``."""
    _ip("link", "add", device, "netns", namespace, "type", "veth", "peer", "name", peer, "netns", peer_namespace)


def _add_bridge(hub: str, bridge: str) -> None:
    """A namespace ``hub`` holding the bridge ``bridge``, up."""
    _add_namespace(hub)
    _ip("-n", hub, "link", "add", bridge, "type", "bridge")
    _ip("-n", hub, "link", "set", bridge, "up")


def _plug(host: "Host", port: str, hub: str, bridge: str) -> None:
    """``host``'s namespace, linked to ``bridge`` in ``hub`` through a veth whose end there is ``port``."""
    _add_namespace(host.namespace)
    _veth(host.device, host.namespace, port, hub)
    _ip("-n", hub, "link", "set", port, "master", bridge, "up")
    host.bring_up()


def _delete_namespace(namespace: str) -> None:
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)  # fails harmlessly when absent


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    device: str

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace, *command], check=check, capture_output=True, text=True, timeout=30
        )

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block with this thread in the host's network namespace."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{self.namespace}", os.O_RDONLY)
        try:
            if _libc.setns(target, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespace} failed")
            try:
                yield
            finally:
                if _libc.setns(own, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the test's own namespace failed")
        finally:
            os.close(own)
            os.close(target)

    def free_port(self) -> int:
        with self.entered(), socket.socket() as probe:
            probe.bind((self.address, 0))
            return probe.getsockname()[1]

    @contextmanager
    def drop_inbound_tcp(self, port: int) -> Iterator[None]:
        """This host's firewall silently drops new inbound TCP connections to ``port`` (outbound is untouched)."""
        table = f"agora_drop_{port}"
        self.run("nft", "add", "table", "inet", table)
        try:
            self.run(
                "nft", "add", "chain", "inet", table, "input", "{ type filter hook input priority 0; policy accept; }"
            )
            self.run(
                "nft", "add", "rule", "inet", table, "input", "tcp", "dport", str(port), "ct", "state", "new", "drop"
            )
            yield
        finally:
            self.run("nft", "delete", "table", "inet", table, check=False)

    def shape_uplink(self, mbit: float) -> None:
        """Limit what this host sends to ``mbit`` Mbit/s.

        A token bucket on its interface; replaces an earlier limit."""
        burst = max(TBF_MIN_BURST_BYTES, int(mbit * 1e6 / 8 / 100))  # at least 10 ms of traffic at the rate
        self.run(
            "tc",
            "qdisc",
            "replace",
            "dev",
            self.device,
            "root",
            "tbf",
            "rate",
            f"{round(mbit * 1000)}kbit",
            "burst",
            str(burst),
            "latency",
            TBF_LATENCY,
        )

    def unshape_uplink(self) -> None:
        self.run("tc", "qdisc", "del", "dev", self.device, "root", check=False)  # fails harmlessly when not shaped

    def bring_up(self) -> None:
        """Give the host's interface its address and switch it on."""
        _ip("-n", self.namespace, "addr", "add", f"{self.address}/24", "dev", self.device)
        _ip("-n", self.namespace, "link", "set", self.device, "up")

    def remove(self) -> None:
        """Kill what runs in the namespace, then delete it with its interfaces and their qdiscs."""
        if os.path.exists(f"/var/run/netns/{self.namespace}"):
            self.kill_all()
            _delete_namespace(self.namespace)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=30)
        return [int(pid) for pid in out.stdout.split()]

    def kill_all(self, grace_s: float = 5.0) -> None:
        """SIGKILL what still runs in the namespace (only what a test started can be there)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)


class TwoHosts:
    """Namespaces ``<prefix>-a`` (``SUBNET``.1) and ``<prefix>-b`` (``SUBNET``.2) on one veth pair."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.a = Host(f"{prefix}-a", f"{SUBNET}.1", f"{prefix[-8:]}a")
        self.b = Host(f"{prefix}-b", f"{SUBNET}.2", f"{prefix[-8:]}b")

    def __enter__(self) -> "TwoHosts":
        try:
            for host in (self.a, self.b):
                _add_namespace(host.namespace)
            _veth(self.a.device, self.a.namespace, self.b.device, self.b.namespace)
            for host in (self.a, self.b):
                host.bring_up()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for host in (self.a, self.b):
            host.remove()

    def __exit__(self, *exc: object) -> None:
        self.close()


class BridgedHosts:
    """``count`` hosts ``<prefix>-h<i>`` (``BRIDGED_SUBNET``.<i+1>).

    Each on a veth into one bridge in ``<prefix>-hub``."""

    def __init__(self, prefix: str, count: int):
        if not 2 <= count <= 250:
            raise ValueError(f"{count} hosts: use 2 to 250")
        tag = prefix[-8:]  # interface names have at most 15 characters
        self.hub, self.bridge = f"{prefix}-hub", f"{tag}br"
        self.hosts = [Host(f"{prefix}-h{i}", f"{BRIDGED_SUBNET}.{i + 1}", f"{tag}h{i}") for i in range(count)]
        self.ports = [f"{tag}p{i}" for i in range(count)]  # the hub's end of each host's veth

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __enter__(self) -> "BridgedHosts":
        try:
            _add_bridge(self.hub, self.bridge)
            for host, port in zip(self.hosts, self.ports, strict=True):
                _plug(host, port, self.hub, self.bridge)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for host in self.hosts:
            host.remove()
        _delete_namespace(self.hub)

    def __exit__(self, *exc: object) -> None:
        self.close()
