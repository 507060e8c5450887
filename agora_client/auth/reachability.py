"""Can other peers reach a joiner? The auth service dials its announced address back before admission.

Server side: ``dial_back`` opens a real TCP connection from the auth host to the address the joiner
announced (its libp2p port). Client side: ``advice`` turns a failed check into steps a person can
act on: which port, tested from where, and what to open.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agora_client.events import NetworkFinding
from agora_client.network.addresses import local_address_towards

DEFAULT_BASE_PORT = 49200
LIBP2P_HELLO = b"/multistream/1.0.0\n"  # a libp2p host's first words on a new connection


class AnnounceError(ValueError):
    """An ``--announce-addr`` that is not HOST:PORT."""


@dataclass(frozen=True)
class DialResult:
    """One dial-back: where to, from where, and how it went (``error`` is timeout, refused or unroutable)."""

    host: str
    port: int
    tested_from: str
    reachable: bool
    error: str = ""
    seconds: float = 0.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DialResult":
        return cls(
            host=str(data["host"]),
            port=int(data["port"]),
            tested_from=str(data.get("tested_from", "")),
            reachable=bool(data["reachable"]),
            error=str(data.get("error", "")),
            seconds=float(data.get("seconds", 0.0)),
        )


def default_host_port(gpu: int | None) -> int:
    """49200 + the GPU index (49200 on CPU): one runtime per GPU, each on its own port."""
    return DEFAULT_BASE_PORT + (gpu or 0)


def parse_announce(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AnnounceError(
            f"--announce-addr {text!r} is not HOST:PORT: give the public address and port other peers should dial, "
            "e.g. 203.0.113.7:49200"
        )
    return host, int(port)


def dial_back(host: str, port: int, timeout_s: float = 5.0, through_relay: bool = False) -> DialResult:
    """A real TCP connect from this host to ``host:port``; never raises for network failures. Through a relay,
    which accepts connections for the worker, the worker's libp2p host must also answer (it speaks first)."""
    tested_from = _source_address(host)
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as connection:
            if through_relay and LIBP2P_HELLO not in _first_bytes(connection, started + timeout_s):
                return DialResult(host, port, tested_from, False, "silent", round(time.monotonic() - started, 2))
    except (socket.timeout, TimeoutError):
        return DialResult(host, port, tested_from, False, "timeout", round(time.monotonic() - started, 2))
    except ConnectionRefusedError:
        return DialResult(host, port, tested_from, False, "refused", round(time.monotonic() - started, 2))
    except OSError as error:
        kind = "unroutable" if error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH) else f"error {error.errno}"
        return DialResult(host, port, tested_from, False, kind, round(time.monotonic() - started, 2))
    return DialResult(host, port, tested_from, True, "", round(time.monotonic() - started, 2))


def _first_bytes(connection: socket.socket, deadline: float) -> bytes:
    """What the other side says first, until it has said the libp2p greeting, closes, or the deadline passes."""
    received = b""
    while LIBP2P_HELLO not in received and len(received) < len(LIBP2P_HELLO) + 8:
        connection.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = connection.recv(64)
        except (socket.timeout, TimeoutError):  # connected, but nobody behind the relay spoke
            break
        if not chunk:
            break
        received += chunk
    return received


def advice(result: DialResult, announced: bool, findings: Sequence[NetworkFinding] = ()) -> list[str]:
    """What a person can do about a failed dial-back, most likely cause first: the client's diagnosis of its
    network (``findings``) where it found something, else the usual suspects."""
    port = result.port
    why = {
        "timeout": "the connection attempt got no answer: a firewall or a NAT dropped it",
        "refused": "the address answered but nothing accepts connections on that port",
        "unroutable": "there is no route to that address from the swarm",
        "silent": "the relay took the connection, but the worker behind it did not answer",
    }.get(result.error, f"the connection failed ({result.error})")
    summary = (
        f"The swarm could not connect to your worker at {result.address} (TCP port {port}), "
        f"tested from {result.tested_from}: {why}."
    )
    if findings:
        return [
            summary,
            *(f"{finding.what}. {finding.action}" for finding in findings),
            f"Local firewall: allow inbound TCP on port {port} if it blocks it.",
        ]
    lines = [
        summary,
        f"Local firewall: allow inbound TCP on port {port} (e.g. `sudo ufw allow {port}/tcp`).",
        f"Home router: forward TCP port {port} to this machine's LAN address.",
        f"Cloud machine: open inbound TCP {port} in the instance's security group / firewall rules.",
    ]
    if result.error == "refused" and not announced:
        lines.append("If another program holds the port, pick another with --host-port.")
    lines.append(
        "If your provider maps a different public port or address to this machine, pass it with "
        "--announce-addr PUBLIC_HOST:PUBLIC_PORT" + (" (the one given now is not reachable)." if announced else ".")
    )
    return lines


def _source_address(host: str) -> str:
    """The local address this host dials ``host`` from."""
    return f"{local_address_towards(host) or 'unknown address'} (the swarm's auth service, {socket.gethostname()})"
