"""A relay's series for operators: reservations held against its limit, the bytes they relayed, refusals by reason."""

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
REFUSALS = Series(
    "agora_relay_refusals",
    "counter",
    "requests and connections the relay refused, by reason (no_pass, expired_pass, wrong_key, port_held, "
    "per_network, per_identity, waiting, splices, idle, ...)",
    ("reason",),
)
SERIES = (RESERVATIONS, CAPACITY, RELAYED_BYTES, REFUSALS)


def relay_collector(server: RelayServer) -> SeriesCollector:
    def read() -> dict[str, Values]:
        held = server.reservations()
        return {
            RESERVATIONS.name: len(held),
            CAPACITY.name: server.settings.max_reservations,
            RELAYED_BYTES.name: sum(info.bytes for info in held),
            REFUSALS.name: server.refusal_counts(),
        }

    return SeriesCollector(SERIES, read)
