"""A seed's series for operators: the DHT peers it knows (what joiners find through it)."""

from __future__ import annotations

from hivemind import DHT

from agora_client.engine.dht_peers import known_peers
from agora_client.operator_metrics import Series, SeriesCollector

DHT_PEERS = Series("agora_seed_dht_peers", "gauge", "peers in the seed's DHT routing table")
SERIES = (DHT_PEERS,)


def seed_collector(dht: DHT) -> SeriesCollector:
    return SeriesCollector(SERIES, lambda: {DHT_PEERS.name: known_peers(dht)})
