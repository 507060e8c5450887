"""How many peers a DHT node knows: its routing table, read inside the DHT's own process.

hivemind has no public count of a node's peers; ``DHT.run_coroutine`` runs a function on the running DHTNode, whose
``protocol.routing_table`` maps every peer it keeps (replacements included) in ``uid_to_peer_id``.
"""

from __future__ import annotations

from hivemind import DHT
from hivemind.dht.node import DHTNode

__all__ = ["known_peers"]


async def _routing_table_size(_dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def known_peers(dht: DHT) -> int:
    return dht.run_coroutine(_routing_table_size)
