"""A relay reservation that is reserved again when it is lost (the relay restarted, the link dropped).

The worker announced the relay's address for it, and the swarm keeps dialing that address. So after a loss
the worker asks the relay for the same public port back (the relay keeps a released port for the worker that
held it), trying again after growing waits until it gets one or is closed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from .client import RelayReservation, RelayUnavailable
from .proof import PeerCredentials

RESERVE_AGAIN_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # waits before each try; then every 30 s until it works


class KeptReservation:
    """``open`` reserves as RelayReservation does; after a loss ``on_lost(reason)`` is told and the port reserved
    again, then ``on_restored(address, same)`` (``same``: the announced address still holds)."""

    def __init__(
        self,
        relay: str,
        local_port: int,
        *,
        on_lost: Callable[[str], None],
        on_restored: Callable[[str, bool], None],
        credentials: PeerCredentials | None,
        waits: Sequence[float] = RESERVE_AGAIN_S,
    ):
        self.relay, self.local_port, self.credentials = relay, local_port, credentials
        self.on_lost, self.on_restored, self.waits = on_lost, on_restored, tuple(waits)
        self.announced = ""  # the first address: the one the worker announced
        self._current: RelayReservation | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def address(self) -> str | None:
        return self._current.address if self._current is not None else None

    @property
    def rtt_s(self) -> float | None:
        return self._current.rtt_s if self._current is not None else None

    def open(self) -> str:
        """Reserve a public port; its "host:port". RelayUnavailable says why not."""
        self._current = self._reserve(port=None)
        self.announced = self._current.address
        return self.announced

    def close(self) -> None:
        """Give the port back and stop reserving it again (a try under way gives back what it gets); idempotent."""
        self._closed.set()
        with self._lock:
            if self._current is not None:
                self._current.close()

    def _reserve(self, port: int | None) -> RelayReservation:
        reservation = RelayReservation(self.relay, self.local_port, on_lost=self._lost, credentials=self.credentials)
        reservation.open(port=port)
        return reservation

    def _lost(self, reason: str) -> None:
        if self._closed.is_set():
            return
        self.on_lost(reason)
        threading.Thread(target=self._reserve_again, name="relay-reserve-again", daemon=True).start()

    def _reserve_again(self) -> None:
        port = int(self.announced.rpartition(":")[2])
        for attempt in itertools.count():
            if self._closed.wait(self.waits[min(attempt, len(self.waits) - 1)]):
                return
            try:
                reservation = self._reserve(port)
            except RelayUnavailable:
                continue
            with self._lock:
                lost, self._current = self._current, reservation
                if self._closed.is_set():  # closed while reserving: give this one back too
                    reservation.close()
                    return
            lost.close()
            self.on_restored(reservation.address, reservation.address == self.announced)
            return
