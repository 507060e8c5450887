"""The relay server: control port, one public port per reservation, and the splicing in between.

Everything runs on one asyncio loop in a background thread; ``RelayServer`` is its thread-safe handle.
A connection that misbehaves is answered (where it can be) and closed; it never reaches the others.
Only joiners the auth service sent here reserve (``proof``); what they may hold is bounded per IPv4 /24 or IPv6
/64, per identity and in all; so are the connections waiting for their first request, the spliced connections of
one reservation and their idle time. Every refusal is logged with its reason and counted (``refusal_counts``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from agora_client.auth.tickets import load_public_key

from .proof import Reserver, ReserveRefused, SeenNonces, check_reserve
from .protocol import MAX_LINE, VERSION, ProtocolError, decode, encode, join_address

log = logging.getLogger(__name__)
CHUNK = 64 * 1024


@dataclass(frozen=True)
class RelaySettings:
    host: str = "0.0.0.0"
    port: int = 0  # control port; 0: any free one (RelayServer.port tells which)
    public_host: str = "127.0.0.1"  # the host name or address workers are told to announce
    port_lo: int = 50000
    port_hi: int = 50100
    auth_public_key: str = ""  # the auth service's (its /v1/status): only its relay passes and tickets reserve
    max_reservations: int = 64
    per_network: int = 4  # reservations one IPv4 /24 or IPv6 /64 may hold
    per_identity: int = 4  # reservations one identity (the account its pass names) may hold
    ping_every_s: float = 20.0  # a control connection silent for three pings is released
    pending_timeout_s: float = 10.0  # how long a public connection waits for the worker's accept
    max_pending: int = 32  # per reservation
    hello_timeout_s: float = 10.0  # how long a new control-port connection may take to send its request
    hold_released_s: float = 120.0  # a released port goes back only to the peer that held it, for this long
    max_waiting: int = 256  # control-port connections yet to send their first request, from all sources
    max_waiting_per_network: int = 16  # the same, from one IPv4 /24 or IPv6 /64
    max_splices: int = 64  # public connections one reservation carries at once
    idle_timeout_s: float = 600.0  # a spliced connection that moves no byte either way for this long is closed

    def __post_init__(self) -> None:
        if not 0 < self.port_lo <= self.port_hi < 65536:
            raise ValueError(f"public port range {self.port_lo}-{self.port_hi} is not valid: give LO-HI within 1-65535")
        if min(self.max_reservations, self.per_network, self.per_identity) < 1:
            raise ValueError("--max-reservations, --per-network and --per-identity must be at least 1")
        try:
            load_public_key(self.auth_public_key)
        except ValueError as error:
            raise ValueError(
                f"the relay serves only joiners the auth service sends, so it needs that service's public key "
                f"(--auth-public-key, the public_key of its /v1/status): {error}"
            ) from None


@dataclass(frozen=True)
class ReservationInfo:
    peer_id: str
    address: str  # public host:port
    since: float  # wall-clock time of the reservation
    bytes: int  # relayed so far, both directions


@dataclass(eq=False)
class _Reservation:
    peer_id: str
    identity: str  # the account the pass names
    source: str  # address of the worker's control connection: only it may accept this reservation's connections
    port: int
    control: asyncio.StreamWriter
    address: str = ""
    listener: asyncio.Server | None = None
    since: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    bytes: int = 0
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    streams: set[asyncio.StreamWriter] = field(default_factory=set)
    splices: int = 0  # public connections being carried (or waiting for the worker's accept)
    released: bool = False

    def info(self) -> ReservationInfo:
        return ReservationInfo(self.peer_id, self.address, self.since, self.bytes)


class _RequestRefused(Exception):
    """A request the relay answers with ``{"ok": false, "error": <this text>}``; ``reason``: the metrics' code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def network_of(address: str) -> str:
    """The IPv4 /24 or IPv6 /64 of ``address`` (an IPv4-mapped IPv6 address counts as IPv4): the unit of the limits,
    since one home or one hosting customer easily holds a whole /24 or /64."""
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped
    prefix = 24 if parsed.version == 4 else 64
    return str(ipaddress.ip_network(f"{parsed}/{prefix}", strict=False))


async def _read_message(reader: asyncio.StreamReader) -> dict:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"line longer than {MAX_LINE} bytes; send one short JSON object per line") from None
    except (asyncio.IncompleteReadError, ConnectionError):
        raise ProtocolError("the connection closed before a full line arrived") from None
    return decode(line)


async def _refuse(writer: asyncio.StreamWriter, error: str) -> None:
    """Answer an error where the connection still takes it, then close it."""
    try:
        writer.write(encode({"ok": False, "error": error}))
        await asyncio.wait_for(writer.drain(), 1.0)
    except (ConnectionError, OSError, asyncio.TimeoutError):
        pass
    writer.close()


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    reservation: _Reservation,
    other: asyncio.StreamWriter,
    moved: list[float],
) -> None:
    """Copy one direction until end of stream, then pass the half-close on; on an error close both sides.
    ``moved[0]``: when a byte last crossed, shared by both directions of one splice."""
    try:
        while data := await reader.read(CHUNK):
            moved[0] = time.monotonic()
            writer.write(data)
            reservation.bytes += len(data)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
        other.close()


class RelayServer:
    """The relay, in-process: ``start()`` returns once it listens, ``stop()`` releases everything."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.port = settings.port
        self._reservations: list[_Reservation] = []
        self._pending: dict[str, _Reservation] = {}  # connection id -> its reservation
        self._held: dict[int, tuple[str, float]] = {}  # released public port -> (its peer id, when)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._control: asyncio.Server | None = None
        self._unsorted: dict[asyncio.StreamWriter, str] = {}  # control connections yet to send a request -> network
        self._auth_key = load_public_key(settings.auth_public_key)
        self._nonces = SeenNonces()
        self._refusals: Counter[str] = Counter()  # by reason, since the start

    # --- the thread-safe handle ---------------------------------------------------------------------

    def start(self) -> RelayServer:
        """Listen on the control port; OSError (e.g. the port is taken) is raised here."""
        loop = asyncio.new_event_loop()
        started = loop.run_until_complete(self._listen_or_fail())
        if isinstance(started, BaseException):
            loop.close()
            raise started
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="relay-server", daemon=True)
        self._thread.start()
        return self

    async def _listen_or_fail(self) -> OSError | None:
        try:
            self._control = await asyncio.start_server(self._on_control, self.settings.host, self.settings.port)
        except OSError as error:
            return error
        self.port = self._control.sockets[0].getsockname()[1]
        return None

    def stop(self) -> None:
        """Release every reservation, close every connection and the control port; idempotent."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        loop.close()

    def reservations(self) -> list[ReservationInfo]:
        """A snapshot of the reservations held now."""
        if self._loop is None:
            return []

        async def snapshot() -> list[ReservationInfo]:
            return [reservation.info() for reservation in self._reservations]

        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(timeout=10)

    def refusal_counts(self) -> dict[str, int]:
        """Requests and connections refused since the start, by reason (each one is logged too)."""
        if self._loop is None:
            return dict(self._refusals)

        async def snapshot() -> dict[str, int]:
            return dict(self._refusals)

        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(timeout=10)

    def _refused(self, reason: str, source: str, message: str) -> None:
        self._refusals[reason] += 1
        log.info("refused %s (%s): %s", source, reason, message)

    def __enter__(self) -> RelayServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _shutdown(self) -> None:
        """Close every connection and let each handler end on its own: Python 3.11's streams log an error
        for a connection handler that is cancelled, so cancelling is left for handlers that do not end."""
        self._control.close()
        for reservation in list(self._reservations):
            self._release(reservation, "the relay is stopping")
        for writer in list(self._unsorted):
            writer.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for task in tasks:
            task.cancel()

    # --- the control port -----------------------------------------------------------------------------

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A new connection to the control port: a reservation's control connection or a worker's accept."""
        source = (writer.get_extra_info("peername") or ("?",))[0]
        if not self._room_to_wait(source):
            writer.close()
            return
        try:
            self._unsorted[writer] = network_of(source)
            try:
                request = await asyncio.wait_for(_read_message(reader), self.settings.hello_timeout_s)
            finally:
                self._unsorted.pop(writer, None)
            await self._dispatch(request, source, reader, writer)
        except asyncio.TimeoutError:
            message = (
                f"no request within {self.settings.hello_timeout_s:g} s; send one JSON line right after connecting"
            )
            self._refused("silent", source, message)
            await _refuse(writer, message)
        except ProtocolError as error:
            self._refused("malformed", source, str(error))
            await _refuse(writer, str(error))
        except (_RequestRefused, ReserveRefused) as error:
            self._refused(error.reason, source, str(error))
            await _refuse(writer, str(error))
        except asyncio.CancelledError:  # the relay is stopping
            writer.close()
            raise
        except Exception:  # a bug in one connection's handling must not take the relay down
            log.exception("unexpected error on a control connection from %s", source)
            writer.close()

    def _room_to_wait(self, source: str) -> bool:
        """Whether one more connection from ``source`` may wait for its first request (refused and logged if not)."""
        network = network_of(source)
        if len(self._unsorted) >= self.settings.max_waiting:
            self._refused("waiting", source, f"{self.settings.max_waiting} connections wait for their first request")
            return False
        if sum(waiting == network for waiting in self._unsorted.values()) >= self.settings.max_waiting_per_network:
            limit = self.settings.max_waiting_per_network
            self._refused("waiting", source, f"{limit} connections from {network} wait for their first request")
            return False
        return True

    async def _dispatch(
        self, request: dict, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if request.get("v") != VERSION:
            raise _RequestRefused(
                "version",
                f"protocol version {request.get('v')!r} is not spoken here; "
                f"this relay speaks version {VERSION}: update the client",
            )
        if request.get("op") == "reserve":
            await self._serve_reservation(request, source, reader, writer)
        elif request.get("op") == "accept":
            self._accept(request, source, reader, writer)
        else:
            raise _RequestRefused("malformed", f'unknown op {request.get("op")!r}: expected "reserve" or "accept"')

    def _check_room(self, reserver: Reserver, source: str) -> None:
        settings, network = self.settings, network_of(source)
        if len(self._reservations) >= settings.max_reservations:
            raise _RequestRefused(
                "full",
                f"the relay is full ({settings.max_reservations} reservations); try again later or use another relay",
            )
        if sum(network_of(held.source) == network for held in self._reservations) >= settings.per_network:
            raise _RequestRefused(
                "per_network",
                f"too many reservations from {network} ({settings.per_network} allowed); "
                "close one of your other workers' reservations first",
            )
        if sum(held.identity == reserver.identity for held in self._reservations) >= settings.per_identity:
            raise _RequestRefused(
                "per_identity",
                f"too many reservations for {reserver.identity} ({settings.per_identity} allowed); "
                "close one of your other workers' reservations first",
            )

    def _bind_public_port(self, wanted: object, peer_id: str) -> socket.socket:
        """The port the request asks back (``port``: the worker announced it before losing its reservation) if it
        is free and not held for another peer, else the first free one that no other peer released less than
        ``hold_released_s`` ago."""
        now = time.monotonic()
        self._held = {
            port: (owner, at) for port, (owner, at) in self._held.items() if now - at < self.settings.hold_released_s
        }
        if wanted in self._held and self._held[wanted][0] != peer_id:
            raise _RequestRefused(
                "port_held",
                f"port {wanted} is held for the peer that had it, for up to {self.settings.hold_released_s:g} s "
                "after its release; reserve without naming a port",
            )
        taken = {reservation.port for reservation in self._reservations}
        candidates = [
            port
            for port in range(self.settings.port_lo, self.settings.port_hi + 1)
            if port not in taken and self._held.get(port, (peer_id,))[0] == peer_id
        ]
        if isinstance(wanted, int) and wanted not in taken and self.settings.port_lo <= wanted <= self.settings.port_hi:
            candidates.insert(0, wanted)
        for port in candidates:
            try:
                return socket.create_server((self.settings.host, port))
            except OSError:  # in use by another program: try the next
                continue
        raise _RequestRefused("no_port", "no free public port on the relay; try again later or use another relay")

    async def _serve_reservation(
        self, request: dict, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        reserver = check_reserve(request, self._auth_key, time.time(), self._nonces)
        self._check_room(reserver, source)
        sock = self._bind_public_port(request.get("port"), reserver.peer_id)  # no await from the checks to the end
        reservation = _Reservation(reserver.peer_id, reserver.identity, source, sock.getsockname()[1], writer)
        reservation.address = join_address(self.settings.public_host, reservation.port)
        self._reservations.append(reservation)
        reason = "the control connection closed"
        try:
            reservation.listener = await asyncio.start_server(
                lambda r, w: self._on_public(reservation, r, w), sock=sock
            )
            writer.write(encode({"ok": True, "address": reservation.address}))
            await writer.drain()
            log.info(
                "reserved %s for %s of %s (from %s)", reservation.address, reserver.peer_id, reserver.identity, source
            )
            reason = await self._keep_alive(reader, writer)
        except (ConnectionError, OSError) as error:
            reason = f"the control connection failed: {error}"
        finally:
            self._release(reservation, reason)
            sock.close()  # the listener's socket: closed already unless start_server failed

    async def _keep_alive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Ping the worker and read its lines until it goes silent for three pings or closes; returns why it ended."""
        pinger = asyncio.create_task(self._ping(writer))
        try:
            while True:
                try:
                    await asyncio.wait_for(_read_message(reader), 3 * self.settings.ping_every_s)
                except asyncio.TimeoutError:
                    return f"the worker answered no ping in {3 * self.settings.ping_every_s:g} s"
                except ProtocolError as error:
                    return "the worker closed the control connection" if reader.at_eof() else str(error)
        finally:
            pinger.cancel()

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        while True:
            await asyncio.sleep(self.settings.ping_every_s)
            writer.write(encode({"op": "ping"}))
            await writer.drain()

    def _release(self, reservation: _Reservation, reason: str) -> None:
        if reservation.released:
            return
        reservation.released = True
        self._reservations.remove(reservation)
        self._held[reservation.port] = (reservation.peer_id, time.monotonic())
        if reservation.listener is not None:
            reservation.listener.close()
        for connection_id, matched in reservation.pending.items():
            self._pending.pop(connection_id, None)
            if not matched.done():
                matched.set_result(None)
        for stream in (reservation.control, *reservation.streams):
            stream.close()
        log.info(
            "released %s for %s (from %s): held %.0f s, %d bytes relayed; %s",
            reservation.address,
            reservation.peer_id,
            reservation.source,
            time.monotonic() - reservation.started,
            reservation.bytes,
            reason,
        )

    # --- public connections and their splicing ---------------------------------------------------------

    async def _on_public(
        self, reservation: _Reservation, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Someone connected to a reservation's public port: ask the worker for a data connection, then splice."""
        if not self._room_to_splice(reservation, writer):
            writer.close()
            return
        reservation.splices += 1
        try:
            await self._connect_and_splice(reservation, reader, writer)
        finally:
            reservation.splices -= 1

    def _room_to_splice(self, reservation: _Reservation, writer: asyncio.StreamWriter) -> bool:
        """Whether the reservation takes one more public connection (refused and logged if not)."""
        if reservation.released:
            return False
        source = f"{(writer.get_extra_info('peername') or ('?',))[0]} on {reservation.address}"
        if len(reservation.pending) >= self.settings.max_pending:
            self._refused("pending", source, f"{self.settings.max_pending} connections wait for the worker's accept")
            return False
        if reservation.splices >= self.settings.max_splices:
            self._refused("splices", source, f"the reservation carries {self.settings.max_splices} connections")
            return False
        return True

    async def _connect_and_splice(
        self, reservation: _Reservation, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        connection_id = secrets.token_hex(16)
        matched = asyncio.get_running_loop().create_future()
        reservation.pending[connection_id] = matched
        self._pending[connection_id] = reservation
        reservation.streams.add(writer)
        try:
            reservation.control.write(encode({"op": "connect", "id": connection_id}))
            worker = await asyncio.wait_for(matched, self.settings.pending_timeout_s)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            worker = None
        finally:
            reservation.pending.pop(connection_id, None)
            self._pending.pop(connection_id, None)
        if worker is None:
            reservation.streams.discard(writer)
            writer.close()
            return
        await self._splice(reservation, (reader, writer), worker)

    def _accept(self, request: dict, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection_id = request.get("id")
        reservation = self._pending.get(connection_id) if isinstance(connection_id, str) else None
        matched = reservation.pending.get(connection_id) if reservation is not None else None
        if matched is None or matched.done() or reservation.source != source:
            raise _RequestRefused(
                "unknown_accept", "unknown or expired connection id; accept each connect at once, and only once"
            )
        del reservation.pending[connection_id], self._pending[connection_id]
        reservation.streams.add(writer)
        matched.set_result((reader, writer))  # the public connection's handler splices them

    async def _splice(
        self,
        reservation: _Reservation,
        public: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        worker: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        """Carry both directions until both end, or until no byte has moved for ``idle_timeout_s``."""
        moved = [time.monotonic()]
        pipes = asyncio.gather(
            _pipe(public[0], worker[1], reservation, public[1], moved),
            _pipe(worker[0], public[1], reservation, worker[1], moved),
        )
        try:
            while not pipes.done():
                idle_left = moved[0] + self.settings.idle_timeout_s - time.monotonic()
                if idle_left <= 0:
                    where = f"a connection on {reservation.address}"
                    self._refused("idle", where, f"no byte moved for {self.settings.idle_timeout_s:g} s; closed")
                    break
                await asyncio.wait({pipes}, timeout=idle_left)
        finally:
            for stream in (public[1], worker[1]):
                stream.close()
                reservation.streams.discard(stream)
            await asyncio.wait({pipes}, timeout=5)  # closed streams end both pipes
