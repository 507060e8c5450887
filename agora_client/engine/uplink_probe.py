"""A worker's own uplink, measured by sending bytes to a peer that times their arrival (libp2p stream handlers).

In a butterfly all-reduce the slowest sender paces every member, so the rates a round shows are the group's,
not this worker's. Sending a probe to one peer alone, with nothing else waiting on it, shows this worker's own:
the receiving peer times the bytes from the first to arrive to the last, so neither the sender's socket
buffers nor the connection's setup count.

The sink takes one probe per stream: an 8-byte big-endian size (at most ``MAX_PROBE_BYTES``), that many bytes,
then it answers how many bytes arrived after its first chunk and in how many seconds (big-endian, 8 bytes each).
"""

from __future__ import annotations

import asyncio
import struct
import time

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from .expert_calls import run_coroutine

PROBE_HANDLER = "agora.uplink_probe"
MAX_PROBE_BYTES = 32 << 20
CONCURRENT_PROBES = 2  # a stage's members probe one at a time; more at once would measure each other
SINK_TIMEOUT_S = 120.0  # a probe that has not arrived by then is given up (probes are sized to last about a second)
_CHUNK = 1 << 16
_SIZE, _TIMED = struct.Struct(">Q"), struct.Struct(">Qd")


class ProbeFailed(RuntimeError):
    """The probe could not be sent or timed; the message says why."""


async def _receive_probe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        (size,) = _SIZE.unpack(await asyncio.wait_for(reader.readexactly(_SIZE.size), SINK_TIMEOUT_S))
        if not 0 < size <= MAX_PROBE_BYTES:
            return  # closed without an answer: the sender hears the probe was refused
        timed, seconds = await asyncio.wait_for(_timed_read(reader, size), SINK_TIMEOUT_S)
        writer.write(_TIMED.pack(timed, seconds))
        await writer.drain()
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass  # a sender that stalled or vanished gets no answer
    finally:
        writer.close()


async def _timed_read(reader: asyncio.StreamReader, size: int) -> tuple[int, float]:
    """Read ``size`` bytes; those after the first chunk, and the seconds from its end to the last one's."""
    first = await reader.read(min(size, _CHUNK))
    if not first:
        raise asyncio.IncompleteReadError(b"", size)
    started, remaining = time.monotonic(), size - len(first)
    while remaining:
        chunk = await reader.read(min(remaining, _CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", remaining)
        remaining -= len(chunk)
    return size - len(first), time.monotonic() - started


def serve_uplink_probes(p2p: P2P) -> None:
    """Let peers measure their uplink by sending probes to this one, ``CONCURRENT_PROBES`` at a time (one more is
    closed unanswered); several clients of one daemon may serve them: it hands each probe to one of them."""
    receiving = asyncio.Semaphore(CONCURRENT_PROBES)

    async def receive(_: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if receiving.locked():
            writer.close()
            return
        async with receiving:
            await _receive_probe(reader, writer)

    run_coroutine(p2p.add_binary_stream_handler(PROBE_HANDLER, receive, balanced=True))


def probe_uplink(p2p: P2P, peer: str, size: int, timeout: float) -> float:
    """This worker's uplink in bytes/s: ``size`` bytes sent to ``peer`` (which serves probes), as it timed them."""
    if not _CHUNK < size <= MAX_PROBE_BYTES:
        raise ValueError(f"a probe is {_CHUNK + 1} to {MAX_PROBE_BYTES} bytes, not {size}")
    try:
        timed, seconds = run_coroutine(asyncio.wait_for(_send_probe(p2p, peer, size), timeout))
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, P2PDaemonError) as error:
        raise ProbeFailed(f"the uplink probe to {peer} failed ({type(error).__name__}: {error})") from None
    if not (0 < timed <= size and seconds > 0):
        raise ProbeFailed(f"{peer} timed {timed} bytes of the probe in {seconds} s")
    return timed / seconds


async def _send_probe(p2p: P2P, peer: str, size: int) -> tuple[int, float]:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROBE_HANDLER)
    try:
        writer.write(_SIZE.pack(size))
        block, sent = bytes(_CHUNK), 0
        while sent < size:
            writer.write(block[: min(_CHUNK, size - sent)])
            await writer.drain()
            sent += min(_CHUNK, size - sent)
        timed, seconds = _TIMED.unpack(await reader.readexactly(_TIMED.size))
        return timed, seconds
    finally:
        writer.close()
