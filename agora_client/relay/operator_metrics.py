"""A relay's series for operators: reservations held against its limit, and the bytes they relayed."""

from __future__ import annotations

from agora_client.operator_metrics import Series, SeriesCollector, Values

from .server import RelayServer

RESERVATIONS = Series("agora_relay_reservations", "gauge", "public ports held for workers now")
CAPACITY = Series(
    "agora_relay_reservation_capacity", "gauge", "reservations the relay holds at most (--max-reservations)"
)
RELAYED_BYTES = Series(
    "agora_relay_relayed_bytes", "gauge", "bytes relayed, both directions, by the reservations held now"
)
SERIES = (RESERVATIONS, CAPACITY, RELAYED_BYTES)


def relay_collector(server: RelayServer) -> SeriesCollector:
    def read() -> dict[str, Values]:
        held = server.reservations()
        return {
            RESERVATIONS.name: len(held),
            CAPACITY.name: server.settings.max_reservations,
            RELAYED_BYTES.name: sum(info.bytes for info in held),
        }

    return SeriesCollector(SERIES, read)
