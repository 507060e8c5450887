"""A worker's own uplink from a probe one peer times (engine/uplink_probe.py), over real libp2p daemons."""

from __future__ import annotations

import pytest
from hivemind import DHT
from hivemind.p2p import PeerID

from agora_client.engine.expert_calls import close_replica, replicate_p2p, run_coroutine
from agora_client.engine.uplink_probe import (
    MAX_PROBE_BYTES,
    PROBE_HANDLER,
    ProbeFailed,
    probe_uplink,
    serve_uplink_probes,
)

TIMEOUT_S = 60.0  # bounds a hang only


@pytest.fixture(scope="module")
def pair():
    sink_dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    sender_dht = DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[str(addr) for addr in sink_dht.get_visible_maddrs()],
    )
    sink, sender = replicate_p2p(sink_dht), replicate_p2p(sender_dht)
    serve_uplink_probes(sink)
    try:
        yield sender, sink_dht.peer_id.to_base58()
    finally:
        close_replica(sink)
        close_replica(sender)
        sender_dht.shutdown()
        sink_dht.shutdown()


def test_a_probe_measures_the_senders_uplink(pair) -> None:
    sender, sink = pair
    rate = probe_uplink(sender, sink, 4 << 20, TIMEOUT_S)
    assert 1e6 < rate < 1e12, rate  # loopback: at least 1 MB/s, and finite


def test_a_peer_without_the_sink_or_a_probe_out_of_bounds_fails_clearly(pair) -> None:
    sender, sink = pair
    with pytest.raises(ValueError, match="a probe is"):
        probe_uplink(sender, sink, MAX_PROBE_BYTES + 1, TIMEOUT_S)
    with pytest.raises(ProbeFailed, match="uplink probe to"):
        probe_uplink(sender, "12D3KooWGjRLHvY2h2Ymjm8EJCxHt5rdPpS84CdXDtvtEhJWNL1F", 1 << 20, 5.0)


def test_malformed_probes_are_dropped_and_the_sink_keeps_serving(pair) -> None:
    sender, sink = pair

    async def send_raw(data: bytes) -> None:
        _, _, writer = await sender.call_binary_stream_handler(PeerID.from_base58(sink), PROBE_HANDLER)
        writer.write(data)
        await writer.drain()
        writer.close()

    run_coroutine(send_raw((MAX_PROBE_BYTES + 1).to_bytes(8, "big")))  # over the bound
    run_coroutine(send_raw((1 << 20).to_bytes(8, "big") + b"short"))  # ends early
    run_coroutine(send_raw(b"\x00"))  # not even a size
    assert probe_uplink(sender, sink, 1 << 20, TIMEOUT_S) > 0
