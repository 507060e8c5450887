"""The relay server: control port, one public port per reservation, and the splicing in between.

Everything runs on one asyncio loop in a background thread; ``RelayServer`` is its thread-safe handle.
A connection that misbehaves is answered (where it can be) and closed; it never reaches the others.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

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
    max_reservations: int = 64
    per_address: int = 4  # reservations one source address may hold
    ping_every_s: float = 20.0  # a control connection silent for three pings is released
    pending_timeout_s: float = 10.0  # how long a public connection waits for the worker's accept
    max_pending: int = 32  # per reservation
    hello_timeout_s: float = 10.0  # how long a new control-port connection may take to send its request
    hold_released_s: float = 120.0  # a released port goes only to a reserve that asks for it back, for this long

    def __post_init__(self) -> None:
        if not 0 < self.port_lo <= self.port_hi < 65536:
            raise ValueError(f"public port range {self.port_lo}-{self.port_hi} is not valid: give LO-HI within 1-65535")
        if self.max_reservations < 1 or self.per_address < 1:
            raise ValueError("--max-reservations and --per-address must be at least 1")


@dataclass(frozen=True)
class ReservationInfo:
    peer_id: str
    address: str  # public host:port
    since: float  # wall-clock time of the reservation
    bytes: int  # relayed so far, both directions


@dataclass(eq=False)
class _Reservation:
    peer_id: str
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
    released: bool = False

    def info(self) -> ReservationInfo:
        return ReservationInfo(self.peer_id, self.address, self.since, self.bytes)


class _RequestRefused(Exception):
    """A request the relay answers with ``{"ok": false, "error": <this text>}``."""


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
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reservation: _Reservation, other: asyncio.StreamWriter
) -> None:
    """Copy one direction until end of stream, then pass the half-close on; on an error close both sides."""
    try:
        while data := await reader.read(CHUNK):
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
        self._held: dict[int, float] = {}  # released public port -> when: its worker may be reserving it back
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._control: asyncio.Server | None = None
        self._unsorted: set[asyncio.StreamWriter] = set()  # control-port connections yet to send their request

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
        try:
            self._unsorted.add(writer)
            try:
                request = await asyncio.wait_for(_read_message(reader), self.settings.hello_timeout_s)
            finally:
                self._unsorted.discard(writer)
            if request.get("v") != VERSION:
                raise _RequestRefused(
                    f"protocol version {request.get('v')!r} is not spoken here; "
                    f"this relay speaks version {VERSION}: update the client"
                )
            if request.get("op") == "reserve":
                await self._serve_reservation(request, source, reader, writer)
            elif request.get("op") == "accept":
                self._accept(request, source, reader, writer)
            else:
                raise _RequestRefused(f'unknown op {request.get("op")!r}: expected "reserve" or "accept"')
        except asyncio.TimeoutError:
            await _refuse(
                writer,
                f"no request within {self.settings.hello_timeout_s:g} s; send one JSON line right after connecting",
            )
        except (ProtocolError, _RequestRefused) as error:
            log.info("refused a request from %s: %s", source, error)
            await _refuse(writer, str(error))
        except asyncio.CancelledError:  # the relay is stopping
            writer.close()
            raise
        except Exception:  # a bug in one connection's handling must not take the relay down
            log.exception("unexpected error on a control connection from %s", source)
            writer.close()

    def _check_room(self, peer_id: object, source: str) -> str:
        if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 256:
            raise _RequestRefused('malformed reserve: "peer_id" must be a non-empty text of at most 256 characters')
        if len(self._reservations) >= self.settings.max_reservations:
            raise _RequestRefused(
                f"the relay is full ({self.settings.max_reservations} reservations); "
                "try again later or use another relay"
            )
        if sum(reservation.source == source for reservation in self._reservations) >= self.settings.per_address:
            raise _RequestRefused(
                f"too many reservations from {source} ({self.settings.per_address} allowed); "
                "close one of your other workers' reservations first"
            )
        return peer_id

    def _bind_public_port(self, wanted: object) -> socket.socket:
        """The port the request asks back (``port``: the worker announced it before losing its reservation) if it
        is free, else the first free one that no worker released less than ``hold_released_s`` ago."""
        now = time.monotonic()
        self._held = {port: at for port, at in self._held.items() if now - at < self.settings.hold_released_s}
        taken = {reservation.port for reservation in self._reservations}
        candidates = [
            port
            for port in range(self.settings.port_lo, self.settings.port_hi + 1)
            if port not in taken and port not in self._held
        ]
        if isinstance(wanted, int) and wanted not in taken and self.settings.port_lo <= wanted <= self.settings.port_hi:
            candidates.insert(0, wanted)
        for port in candidates:
            try:
                return socket.create_server((self.settings.host, port))
            except OSError:  # in use by another program: try the next
                continue
        raise _RequestRefused("no free public port on the relay; try again later or use another relay")

    async def _serve_reservation(
        self, request: dict, source: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer_id = self._check_room(request.get("peer_id"), source)
        sock = self._bind_public_port(request.get("port"))  # no await between the checks, the bind and the registration
        reservation = _Reservation(peer_id, source, sock.getsockname()[1], writer)
        reservation.address = join_address(self.settings.public_host, reservation.port)
        self._reservations.append(reservation)
        reason = "the control connection closed"
        try:
            reservation.listener = await asyncio.start_server(
                lambda r, w: self._on_public(reservation, r, w), sock=sock
            )
            writer.write(encode({"ok": True, "address": reservation.address}))
            await writer.drain()
            log.info("reserved %s for %s (from %s)", reservation.address, peer_id, source)
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
        self._held[reservation.port] = time.monotonic()
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
        if reservation.released or len(reservation.pending) >= self.settings.max_pending:
            writer.close()
            return
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
            raise _RequestRefused("unknown or expired connection id; accept each connect at once, and only once")
        del reservation.pending[connection_id], self._pending[connection_id]
        reservation.streams.add(writer)
        matched.set_result((reader, writer))  # the public connection's handler splices them

    async def _splice(
        self,
        reservation: _Reservation,
        public: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        worker: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        try:
            await asyncio.gather(
                _pipe(public[0], worker[1], reservation, public[1]), _pipe(worker[0], public[1], reservation, worker[1])
            )
        finally:
            for stream in (public[1], worker[1]):
                stream.close()
                reservation.streams.discard(stream)
