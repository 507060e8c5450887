"""A worker's own uplink from a probe one peer times (engine/uplink_probe.py), over real libp2p daemons: only the
ticketed members of the sink's latest averaging group may probe it (averaging/probe_admission.py), one probe at a
time per peer, each whole exchange within one deadline."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
from hivemind import DHT
from hivemind.p2p import PeerID

from agora_client.auth.ticket_source import SelfIssuedTickets
from agora_client.auth.tickets import generate_signing_key
from agora_client.averaging.group_admission import GroupAdmission
from agora_client.averaging.link_timing import LinkMeter, LinkRates
from agora_client.averaging.probe_admission import GroupProbeAdmission
from agora_client.averaging.uplink import UplinkProber
from agora_client.engine.expert_calls import close_replica, replicate_p2p, run_coroutine
from agora_client.engine.uplink_probe import (
    MAX_PROBE_BYTES,
    PROBE_HANDLER,
    ProbeFailed,
    probe_uplink,
    serve_uplink_probes,
)
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.ticket_gate import TicketGate

TIMEOUT_S = 60.0  # bounds a hang only
DEADLINE_S = 3.0  # the sink's bound on a whole probe in these tests (a worker's: uplink.PROBE_DEADLINE_S)
STAGE = "body1"
KEY = generate_signing_key()


def _admission(stage: str = STAGE) -> GroupAdmission:
    """Tickets of the test's auth key: the gate admits ``STAGE`` workers; this peer's own ticket is for ``stage``."""
    gate = TicketGate(SelfIssuedTickets(KEY, role="worker", stage=STAGE).public_key, roles=("worker",), stage=STAGE)
    return GroupAdmission(gate, SelfIssuedTickets(KEY, role="worker", stage=stage), RejectionLog(lambda line: None))


def _dht(*initial: DHT) -> DHT:
    peers = [str(addr) for dht in initial for addr in dht.get_visible_maddrs()]
    return DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers)


class Peer:
    """A worker's libp2p client with its own ticket (for ``stage``)."""

    def __init__(self, dht: DHT, stage: str = STAGE):
        self.id, self.p2p = dht.peer_id.to_base58(), replicate_p2p(dht)
        self.ticket = _admission(stage).credentials(self.id)["ticket"].encode("ascii")

    def probe(self, sink: str, size: int = 1 << 20) -> float:
        return probe_uplink(self.p2p, sink, size, TIMEOUT_S, ticket=self.ticket)


@pytest.fixture(scope="module")
def swarm():
    """A sink whose latest group is {sink, member, wrong_stage}, and a ticketed stranger outside it."""
    sink_dht = _dht()
    dhts = [sink_dht, *(_dht(sink_dht) for _ in range(3))]
    sink = replicate_p2p(sink_dht)
    member, stranger, wrong_stage = Peer(dhts[1]), Peer(dhts[2]), Peer(dhts[3], stage="body2")
    gate = GroupProbeAdmission(sink_dht.peer_id.to_base58(), _admission())
    gate.grouped_with([sink_dht.peer_id.to_base58(), member.id, wrong_stage.id])
    serve_uplink_probes(sink, gate, DEADLINE_S)
    try:
        yield sink_dht.peer_id.to_base58(), member, stranger, wrong_stage
    finally:
        for p2p in (sink, member.p2p, stranger.p2p, wrong_stage.p2p):
            close_replica(p2p)
        for dht in dhts:
            dht.shutdown()


def test_probe_an_honest_members_probe_measures_its_uplink(swarm) -> None:
    sink, member, _, _ = swarm
    rate = member.probe(sink, 4 << 20)
    assert 1e6 < rate < 1e12, rate  # loopback: at least 1 MB/s, and finite


def test_gaming_a_strangers_probe_is_refused(swarm) -> None:
    sink, _, stranger, wrong_stage = swarm
    with pytest.raises(ProbeFailed, match="refused the uplink probe: only members of this worker's latest"):
        stranger.probe(sink)  # a valid ticket for the stage, but not in the sink's group
    with pytest.raises(ProbeFailed, match="refused the uplink probe: wrong_stage"):
        wrong_stage.probe(sink)  # in the group, with a ticket for another stage


async def _open_probe(peer: Peer, sink: str, size: int):
    """A probe's stream, its header sent and the sink's go-ahead read."""
    _, reader, writer = await peer.p2p.call_binary_stream_handler(PeerID.from_base58(sink), PROBE_HANDLER)
    writer.write(struct.pack(">QH", size, len(peer.ticket)) + peer.ticket)
    await writer.drain()
    assert await reader.readexactly(2) == b"\x00\x00", "the sink must let this probe go on"
    return reader, writer


def test_gaming_a_second_concurrent_probe_from_one_peer_is_refused(swarm) -> None:
    sink, member, _, _ = swarm
    size = 1 << 20
    reader, writer = run_coroutine(_open_probe(member, sink, size))
    try:
        with pytest.raises(ProbeFailed, match="a probe of this peer is in flight already"):
            member.probe(sink)

        async def finish() -> tuple[int, float]:
            writer.write(bytes(size))
            await writer.drain()
            return struct.unpack(">Qd", await reader.readexactly(16))

        timed, seconds = run_coroutine(asyncio.wait_for(finish(), TIMEOUT_S))
        assert 0 < timed < size and seconds > 0, "the first probe still measures"
        assert member.probe(sink) > 0, "once answered, the peer may probe again at once"
    finally:
        writer.close()


def test_probe_a_slow_probe_is_cut_at_the_whole_exchange_deadline(swarm) -> None:
    """A sender that dribbles a byte every 50 ms never makes one read wait long: only a deadline on the whole
    exchange ends it; then the sink serves the next probe."""
    sink, member, _, _ = swarm

    async def dribble() -> float:
        reader, writer = await _open_probe(member, sink, MAX_PROBE_BYTES)
        started = time.monotonic()

        async def trickle() -> None:
            while time.monotonic() - started < TIMEOUT_S:
                writer.write(b"\x00")
                await writer.drain()
                await asyncio.sleep(0.05)

        sending = asyncio.ensure_future(trickle())
        try:
            answer = await asyncio.wait_for(reader.read(16), TIMEOUT_S)
        finally:
            sending.cancel()
            writer.close()
        assert answer == b"", "a probe past its deadline gets no answer"
        return time.monotonic() - started

    cut_after = run_coroutine(dribble())
    assert cut_after < DEADLINE_S + 20, f"the dribbling probe was cut only after {cut_after:.1f} s"
    assert member.probe(sink) > 0


def test_malformed_probes_are_dropped_and_the_sink_keeps_serving(swarm) -> None:
    sink, member, _, _ = swarm

    async def send_raw(data: bytes) -> None:
        _, _, writer = await member.p2p.call_binary_stream_handler(PeerID.from_base58(sink), PROBE_HANDLER)
        writer.write(data)
        await writer.drain()
        writer.close()

    run_coroutine(send_raw(struct.pack(">QH", MAX_PROBE_BYTES + 1, 0)))  # over the bound
    run_coroutine(send_raw(struct.pack(">QH", 1 << 20, 60000)))  # a ticket over its bound
    run_coroutine(send_raw(struct.pack(">QH", 1 << 20, len(member.ticket)) + member.ticket + b"short"))  # ends early
    run_coroutine(send_raw(b"\x00"))  # not even a size
    assert member.probe(sink) > 0


def test_a_peer_without_the_sink_or_a_probe_out_of_bounds_fails_clearly(swarm) -> None:
    sink, member, _, _ = swarm
    with pytest.raises(ValueError, match="a probe is"):
        probe_uplink(member.p2p, sink, MAX_PROBE_BYTES + 1, TIMEOUT_S)
    with pytest.raises(ProbeFailed, match="uplink probe to"):
        probe_uplink(member.p2p, "12D3KooWGjRLHvY2h2Ymjm8EJCxHt5rdPpS84CdXDtvtEhJWNL1F", 1 << 20, 5.0)


def test_probe_groupmates_probe_each_other_after_a_round_with_their_tickets(swarm) -> None:
    """Two workers' probers (averaging/uplink.py): after a round together, the one whose turn it is measures."""
    first = _dht()
    second = _dht(first)
    meters = [LinkMeter(LinkRates(1e6, 1e6)) for _ in range(2)]
    probers = [
        UplinkProber(dht, meter, admission=_admission()) for dht, meter in zip((first, second), meters, strict=True)
    ]
    try:
        peers = [first.peer_id.to_base58(), second.peer_id.to_base58()]
        for prober in probers:
            prober.grouped_with(peers)
        lines = [prober.after_round(0, peers) for prober in probers]
        measured = [line for line in lines if line is not None]
        assert len(measured) == 1 and measured[0].startswith("measured this worker's uplink"), lines
        assert max(meter.rates.up for meter in meters) > 1e6  # the probe's figure replaced the assumed 1 MB/s
    finally:
        for prober in probers:
            prober.close()
        first.shutdown()
        second.shutdown()
