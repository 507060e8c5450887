"""Refused requests, counted by reason and logged at most once per caller per interval.

Connection handlers run in forked processes; they report each refusal through a multiprocessing
queue, and this worker's main process counts them and writes the log lines (so a peer flooding
bad requests costs one line per interval, not one per request).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections import Counter
from typing import Callable

LOG_INTERVAL_S = 60.0


class RejectionLog:
    def __init__(self, log: Callable[[str], None], interval: float = LOG_INTERVAL_S):
        self._log, self.interval = log, interval
        self._queue: mp.Queue = mp.get_context("fork").Queue()  # created before the handlers fork
        self.counts: Counter[str] = Counter()
        self._last_logged: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rejections", daemon=True)

    def report(self, caller: str, reason: str, message: str) -> None:
        """Called in a connection handler process for every refused request."""
        self._queue.put_nowait((caller, reason, message))

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                caller, reason, message = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            self._record(caller, reason, message)

    def _record(self, caller: str, reason: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            if now - self._last_logged.get(caller, -self.interval) < self.interval:
                self._unlogged[caller] += 1
                return
            self._last_logged[caller] = now
            unlogged = self._unlogged.pop(caller, 0)
            total = sum(self.counts.values())
        also = f" (+{unlogged} more from this peer since its last line)" if unlogged else ""
        self._log(f"refused a request from peer {caller} ({reason}): {message}{also}; {total} refused in all")

    def totals(self) -> dict[str, int]:
        """Refused requests so far, by reason."""
        with self._lock:
            return dict(self.counts)

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
