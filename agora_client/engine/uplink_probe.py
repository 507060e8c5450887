"""A worker's own uplink, measured by sending bytes to a peer that times their arrival (libp2p stream handlers).

In a butterfly all-reduce the slowest sender paces every member, so the rates a round shows are the group's,
not this worker's. Sending a probe to one peer alone, with nothing else waiting on it, shows this worker's own:
the receiving peer times the bytes from the first to arrive to the last, so neither the sender's socket
buffers nor the connection's setup count.

One probe per stream: the sender sends an 8-byte big-endian size (at most ``MAX_PROBE_BYTES``) and a ticket
(2-byte length, at most ``MAX_TICKET_BYTES``); the sink answers a 2-byte length, 0 to go on, else the UTF-8 reason it
refuses the probe, which follows. Then the sender sends that many bytes, and the sink answers how many arrived
after its first chunk and in how many seconds (big-endian, 8 bytes each). Who may probe is the caller's
``ProbeAdmission``; a sink takes one probe at a time per peer, ``CONCURRENT_PROBES`` in all, and bounds each whole
exchange, header to answer, by one deadline: a sender that dribbles its bytes cannot hold a slot longer.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Protocol

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from .expert_calls import run_coroutine
from .upload_pacing import UploadPacer

PROBE_HANDLER = "agora.uplink_probe"
MAX_PROBE_BYTES = 32 << 20
MAX_TICKET_BYTES = 4096
MAX_REASON_BYTES = 512
CONCURRENT_PROBES = 2  # a stage's members probe one at a time; more at once would measure each other
_CHUNK = 1 << 16
_HEADER, _REPLY, _TIMED = struct.Struct(">QH"), struct.Struct(">H"), struct.Struct(">Qd")


class ProbeFailed(RuntimeError):
    """The probe could not be sent or timed; the message says why."""


class ProbeRefused(ProbeFailed):
    """The peer answered, and refused the probe (the reason is in the message)."""


class ProbeAdmission(Protocol):
    def caller_refusal(self, peer: str) -> str | None:
        """Why ``peer`` may not probe this sink, asked first (None: it may go on to the other checks)."""

    def ticket_refusal(self, peer: str, ticket: bytes) -> str | None:
        """Why the ticket ``peer`` presented does not let it probe (None: it does)."""


class _Sink:
    """The stream handler: one deadline per probe, admission, one probe per peer, ``CONCURRENT_PROBES`` slots."""

    def __init__(self, admission: ProbeAdmission, deadline_s: float):
        self._admission, self._deadline_s = admission, deadline_s
        self._slots = asyncio.Semaphore(CONCURRENT_PROBES)
        self._probing: set[str] = set()  # peers with a probe in flight

    async def receive(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = info.peer_id.to_base58()
        try:
            async with asyncio.timeout(self._deadline_s):
                size, ticket = await _read_header(reader)  # read before any answer: a refusal then reaches the sender
                refusal = self._refusal(caller, size, ticket)
                if refusal is not None:
                    await _refuse(writer, refusal)
                    return
                self._probing.add(caller)  # no await since _refusal: no other probe of this peer got in between
                try:
                    async with self._slots:
                        timed = await _go_and_time(reader, writer, size)
                finally:
                    self._probing.discard(caller)
                writer.write(_TIMED.pack(*timed))  # after the discard: a prober sends its next probe once answered
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # a sender that stalled past the deadline or vanished gets no answer
        finally:
            writer.close()

    def _refusal(self, caller: str, size: int, ticket: bytes | None) -> str | None:
        if (refusal := self._admission.caller_refusal(caller)) is not None:
            return refusal
        if caller in self._probing:
            return "a probe of this peer is in flight already: one at a time"
        if self._slots.locked():
            return f"{CONCURRENT_PROBES} probes are in flight: try again later"
        if not 0 < size <= MAX_PROBE_BYTES or ticket is None:
            return f"a probe is 1 to {MAX_PROBE_BYTES} bytes, its ticket at most {MAX_TICKET_BYTES}"
        return self._admission.ticket_refusal(caller, ticket)


async def _read_header(reader: asyncio.StreamReader) -> tuple[int, bytes | None]:
    """The probe's size and ticket (None: a ticket over ``MAX_TICKET_BYTES``, left unread)."""
    size, ticket_length = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return size, (await reader.readexactly(ticket_length) if ticket_length <= MAX_TICKET_BYTES else None)


async def _go_and_time(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> tuple[int, float]:
    writer.write(_REPLY.pack(0))
    await writer.drain()
    return await _timed_read(reader, size)


async def _refuse(writer: asyncio.StreamWriter, reason: str) -> None:
    text = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    writer.write(_REPLY.pack(len(text)) + text)
    await writer.drain()


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


def serve_uplink_probes(p2p: P2P, admission: ProbeAdmission, deadline_s: float) -> None:
    """Let the peers ``admission`` admits measure their uplink by sending probes to this one, one at a time per
    peer and ``CONCURRENT_PROBES`` in all, each whole exchange within ``deadline_s`` (others are refused, with the
    reason, or closed unanswered); several clients of one daemon may serve them: it hands each probe to one."""
    sink = _Sink(admission, deadline_s)
    run_coroutine(p2p.add_binary_stream_handler(PROBE_HANDLER, sink.receive, balanced=True))


def probe_uplink(
    p2p: P2P, peer: str, size: int, timeout: float, upload: UploadPacer | None = None, *, ticket: bytes = b""
) -> float:
    """This worker's uplink in bytes/s: ``size`` bytes sent to ``peer`` (which serves probes) with this worker's
    ``ticket``, each chunk paced by ``upload`` (an upload cap) if given, as the peer timed them."""
    if not _CHUNK < size <= MAX_PROBE_BYTES:
        raise ValueError(f"a probe is {_CHUNK + 1} to {MAX_PROBE_BYTES} bytes, not {size}")
    if len(ticket) > MAX_TICKET_BYTES:
        raise ValueError(f"a probe's ticket is at most {MAX_TICKET_BYTES} bytes, not {len(ticket)}")
    try:
        timed, seconds = run_coroutine(asyncio.wait_for(_send_probe(p2p, peer, size, ticket, upload), timeout))
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, P2PDaemonError) as error:
        raise ProbeFailed(f"the uplink probe to {peer} failed ({type(error).__name__}: {error})") from None
    if not (0 < timed <= size and seconds > 0):
        raise ProbeFailed(f"{peer} timed {timed} bytes of the probe in {seconds} s")
    return timed / seconds


async def _send_probe(p2p: P2P, peer: str, size: int, ticket: bytes, upload: UploadPacer | None) -> tuple[int, float]:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), PROBE_HANDLER)
    try:
        writer.write(_HEADER.pack(size, len(ticket)) + ticket)
        await writer.drain()
        (refused,) = _REPLY.unpack(await reader.readexactly(_REPLY.size))
        if refused:
            reason = (await reader.readexactly(min(refused, MAX_REASON_BYTES))).decode("utf-8", "replace")
            printable = "".join(char if char.isprintable() else "?" for char in reason)  # a peer's text, for our log
            raise ProbeRefused(f"{peer} refused the uplink probe: {printable}")
        block, sent = bytes(_CHUNK), 0
        while sent < size:
            chunk = min(_CHUNK, size - sent)
            if upload is not None:
                await upload.pace(chunk)
            writer.write(block[:chunk])
            await writer.drain()
            sent += chunk
        timed, seconds = _TIMED.unpack(await reader.readexactly(_TIMED.size))
        return timed, seconds
    finally:
        writer.close()
