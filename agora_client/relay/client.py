"""The worker's side of the relay: reserve a public port and serve each connection made to it.

Plain blocking sockets and threads: one thread reads the control connection (answers pings, takes connects);
each relayed connection gets a thread per direction, splicing the relay's data connection with the worker's
own port on 127.0.0.1.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from .proof import PeerCredentials
from .protocol import MAX_LINE, VERSION, ProtocolError, decode, encode, split_address

log = logging.getLogger(__name__)
CHUNK = 64 * 1024


class RelayUnavailable(Exception):
    """The relay cannot be reached, refused the reservation, or answered something that is not the protocol."""


class _Lines:
    """Reads newline-terminated lines from a socket, each at most MAX_LINE bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def read(self, deadline: float | None = None) -> bytes | None:
        """The next line (without its newline); None at end of stream; TimeoutError past ``deadline``."""
        while b"\n" not in self.buffer:
            if len(self.buffer) >= MAX_LINE:
                raise ProtocolError(f"a line longer than {MAX_LINE} bytes")
            if deadline is not None:
                self.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            chunk = self.sock.recv(MAX_LINE)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def _shut(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock`` and end the connection both ways."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected (any more)
        pass


class RelayReservation:
    """A public port on a relay whose connections reach ``127.0.0.1:local_port``; ``open()`` it, ``close()`` it.

    ``on_lost(reason)`` is called once, from the reservation's thread, if the control connection ends while
    not closed by us: the public address is gone and the worker should reserve again (or announce none).
    ``credentials`` (the worker's key and its relay pass or ticket) sign each reserve: the relay refuses one without.
    """

    def __init__(
        self,
        relay: str,
        local_port: int,
        on_lost: Callable[[str], None],
        timeout_s: float = 10.0,
        *,
        credentials: PeerCredentials | None,
    ) -> None:
        self.relay = relay
        self.local_port = local_port
        self.credentials = credentials
        self.on_lost = on_lost
        self.timeout_s = timeout_s
        self.address: str | None = None  # the public host:port, once open
        self.rtt_s: float | None = None  # the reserve round trip
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self._control: socket.socket | None = None
        self._relay_address: tuple[str, int] = ("", 0)
        self._sockets: set[socket.socket] = set()  # data and local connections being spliced
        self._threads: list[threading.Thread] = []

    @property
    def bytes_relayed(self) -> int:
        with self._lock:
            return self._bytes

    def open(self, port: int | None = None) -> str:
        """Reserve a public port (``port`` again, the one announced before, if the relay still has it free) and start
        serving it; returns its "host:port". RelayUnavailable says why not."""
        try:
            self._relay_address = split_address(self.relay)
        except ValueError as error:
            raise RelayUnavailable(f"bad relay address: {error}") from None
        deadline = time.monotonic() + self.timeout_s
        try:
            control = socket.create_connection(self._relay_address, timeout=self.timeout_s)
        except OSError as error:
            raise RelayUnavailable(
                f"cannot reach the relay at {self.relay} ({error}); check the address and that the relay is running"
            ) from None
        lines = _Lines(control)  # one reader for the whole connection: it may hold the next line already
        try:
            self.address = self._reserve(control, lines, deadline, port)
        except BaseException:
            control.close()
            raise
        self._control = control
        self._start_thread(self._read_control, lines, name="relay-control")
        return self.address

    def _reserve(self, control: socket.socket, lines: _Lines, deadline: float, port: int | None) -> str:
        sent = time.monotonic()
        proof = self.credentials.sign() if self.credentials is not None else {}
        request = {"v": VERSION, "op": "reserve", **proof, **({"port": port} if port else {})}
        try:
            control.sendall(encode(request))
            line = lines.read(deadline)
            self.rtt_s = time.monotonic() - sent
            answer = decode(line) if line is not None else None
        except TimeoutError:
            raise RelayUnavailable(f"the relay at {self.relay} did not answer within {self.timeout_s:g} s") from None
        except (OSError, ProtocolError) as error:
            raise RelayUnavailable(f"the relay at {self.relay} failed the reservation: {error}") from None
        if answer is None:
            raise RelayUnavailable(f"the relay at {self.relay} closed the connection without answering")
        if answer.get("ok") is not True or not isinstance(answer.get("address"), str):
            reason = (
                answer.get("error") if isinstance(answer.get("error"), str) else "an answer that is not the protocol"
            )
            raise RelayUnavailable(f"the relay at {self.relay} refused: {reason}")
        control.settimeout(None)
        return answer["address"]

    def _start_thread(self, target: Callable, *args: object, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [alive for alive in self._threads if alive.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _read_control(self, lines: _Lines) -> None:
        """Answer pings and serve connects until the control connection ends; tell on_lost unless we closed it."""
        reason = "the relay closed the control connection"
        try:
            while (line := lines.read()) is not None:
                message = decode(line)
                if message.get("op") == "ping":
                    self._control.sendall(encode({"op": "pong"}))
                elif message.get("op") == "connect" and isinstance(message.get("id"), str):
                    self._start_thread(self._serve_connection, message["id"], name="relay-connection")
        except (OSError, ProtocolError) as error:
            reason = f"the control connection to the relay failed: {error}"
        if not self._closed:
            _shut(self._control)  # after garbage from the relay: let it release the reservation now
            log.warning("relay reservation %s lost: %s", self.address, reason)
            self.on_lost(reason)

    def _track(self, sock: socket.socket) -> bool:
        """Keep ``sock`` for close(); False (and the socket closed) if we are closing already."""
        with self._lock:
            if not self._closed:
                self._sockets.add(sock)
                return True
        sock.close()
        return False

    def _serve_connection(self, connection_id: str) -> None:
        """Open the data connection for one connect, accept it, and splice it with the local port."""
        opened: list[socket.socket] = []
        try:
            opened.append(socket.create_connection(self._relay_address, timeout=self.timeout_s))
            if not self._track(opened[0]):
                return
            opened[0].sendall(encode({"v": VERSION, "op": "accept", "id": connection_id}))
            opened.append(socket.create_connection(("127.0.0.1", self.local_port), timeout=self.timeout_s))
            if not self._track(opened[1]):
                return
            relay_side, local_side = opened
            for sock in opened:
                sock.settimeout(None)
            other = threading.Thread(target=self._pipe, args=(local_side, relay_side), name="relay-pipe", daemon=True)
            other.start()
            self._pipe(relay_side, local_side)
            other.join()
        except OSError as error:
            log.warning("a relayed connection failed: %s", error)
        finally:
            for sock in opened:
                with self._lock:
                    self._sockets.discard(sock)
                sock.close()

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        """Copy one direction until end of stream, then pass the half-close on; on an error end both sides."""
        try:
            while data := source.recv(CHUNK):
                target.sendall(data)
                with self._lock:
                    self._bytes += len(data)
            target.shutdown(socket.SHUT_WR)
        except OSError:
            _shut(source)
            _shut(target)

    def close(self) -> None:
        """Give the reservation back (the relay releases it at once) and end every relayed connection; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets = list(self._sockets)
            threads = list(self._threads)
        for sock in [self._control, *sockets]:
            if sock is not None:
                _shut(sock)
        for thread in threads:
            if thread is not threading.current_thread():  # close() may be called from on_lost
                thread.join(timeout=self.timeout_s)
        if self._control is not None:
            self._control.close()

    def __enter__(self) -> RelayReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
