"""Two hosts on one machine: Linux network namespaces joined by a veth pair (no loopback shortcut).

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
A later bench may shape the link with ``tc ... tbf`` on ``Host.device``.
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


def unavailable(firewall: bool = False) -> str | None:
    """Why namespace tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if firewall and shutil.which("nft") is None:
        return "nft (nftables) is not installed: apt-get install nftables"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    device: str

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *command], check=check, capture_output=True,
                              text=True, timeout=30)

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
            self.run("nft", "add", "chain", "inet", table, "input", "{ type filter hook input priority 0; policy accept; }")
            self.run("nft", "add", "rule", "inet", table, "input", "tcp", "dport", str(port), "ct", "state", "new", "drop")
            yield
        finally:
            self.run("nft", "delete", "table", "inet", table, check=False)

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
                _ip("netns", "add", host.namespace)
                _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("link", "add", self.a.device, "netns", self.a.namespace, "type", "veth",
                "peer", "name", self.b.device, "netns", self.b.namespace)
            for host in (self.a, self.b):
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.device)
                _ip("-n", host.namespace, "link", "set", host.device, "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for host in (self.a, self.b):
            if os.path.exists(f"/var/run/netns/{host.namespace}"):
                host.kill_all()
                subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.close()
