"""Frees the slots of peers that vanished: the auth service watches each stage's roster in the DHT.

A crashed client never says goodbye; without this its slot would stay held (and count against its
owner's cap) until the ticket expires. Every ``every_s`` seconds the watcher reads the rosters and
``SlotBook.observe`` frees the slots whose peer has been absent for ``vanish_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from .admission import SlotBook

log = logging.getLogger(__name__)


class PresenceWatcher:
    def __init__(
        self,
        book: SlotBook,
        stages: Sequence[str],
        read_roster: Callable[[str], set[str]],
        *,
        every_s: float = 30.0,
        vanish_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ):
        self.book, self.stages, self.read_roster, self.clock = book, tuple(stages), read_roster, clock
        self.every_s, self.vanish_s = every_s, vanish_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence", daemon=True)

    def start(self) -> "PresenceWatcher":
        self._thread.start()
        return self

    def check_once(self) -> None:
        present = {stage: self.read_roster(stage) for stage in self.stages}
        for slot in self.book.observe(present, self.clock(), self.vanish_s):
            log.info(
                "freed slot %d of stage %s: peer %s of %s is gone from the DHT",
                slot.index,
                slot.stage,
                slot.peer_id,
                slot.identity,
            )

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check_once()
            except Exception:  # a DHT hiccup must not end the watch; slots still expire with their tickets
                log.exception("reading the stage rosters failed; trying again in %.0fs", self.every_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 5)


class DhtRosters:
    """Peer ids in a stage's roster, through a client-mode DHT peer started on first use (and retried
    on the next read if no seed answered), so the service starts even while its seeds are down."""

    def __init__(self, seeds: Sequence[str], host: str = "127.0.0.1"):
        self.seeds, self.host = list(seeds), host
        self._dht = None

    def read(self, stage: str) -> set[str]:
        from agora_client.discovery.dht import connect_dht
        from agora_client.discovery.roster import fetch_roster

        if self._dht is None:
            self._dht = connect_dht(self.seeds, host=self.host, client_mode=True)
        return set(fetch_roster(self._dht, stage))

    def close(self) -> None:
        if self._dht is not None:
            self._dht.shutdown()
