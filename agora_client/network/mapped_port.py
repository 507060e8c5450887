"""What a port mapping gives, or why there is none: shared by the router protocols and PortMapping."""

from __future__ import annotations

from dataclasses import dataclass

DESCRIPTION = "Agora worker"  # how the forward is named in the router's list


class MappingUnavailable(Exception):
    """No mapping: no router offered one, or it refused (the message says which, in the router's words)."""

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
