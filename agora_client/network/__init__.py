"""The network between a contributor's machine and the swarm: the home router's port mapping and the diagnosis."""

from agora_client.network.addresses import is_carrier_grade, is_private, local_address_towards, tcp_multiaddr
from agora_client.network.diagnosis import NetworkFacts, diagnose
from agora_client.network.mapped_port import MappedPort, MappingUnavailable
from agora_client.network.port_mapping import PortMapping

__all__ = [
    "MappedPort",
    "MappingUnavailable",
    "NetworkFacts",
    "PortMapping",
    "diagnose",
    "is_carrier_grade",
    "is_private",
    "local_address_towards",
    "tcp_multiaddr",
]
