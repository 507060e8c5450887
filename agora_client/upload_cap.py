"""The contributor's upload cap (``--max-upload-mbit``): one token bucket that all of a worker's senders draw on.

hivemind's p2p daemon writes the sockets, so Python cannot pace them. Every sender therefore takes its message's
bytes from the bucket before it hands them to hivemind: the answers to trainers (the connection handlers), the
SPARTA parts (the averager) and the uplink probes. The bucket lives in shared memory made before the worker forks
its connection handlers and its averager, so every process of the worker spends one budget.

A sender reserves its bytes and waits until the bucket has earned them (a message larger than the bucket waits
for its whole size): over any T seconds a worker hands hivemind at most ``rate x (T + BURST_S)``, charged with
``WIRE_OVERHEAD`` for what the link carries beyond the payload.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import time
from typing import Callable

BITS = 8
MBIT = 1e6 / BITS  # bytes/s in a Mbit/s
MIN_CAP_MBIT = 2.0  # the slowest link a worker may announce (averaging/link_timing.py's MIN_RATE)
BURST_S = 0.5  # the bucket holds half a second's worth: any 10 s carry at most 1.05 x the cap
WIRE_OVERHEAD = 1.04  # TCP/IP headers (~3.6% at a 1448-byte segment), libp2p framing, acknowledgements of downloads
_TOKENS, _REFILLED, _PACED = 0, 1, 2
MAX_UPLOAD_HELP = (
    "hold what the worker uploads (answers to trainers, averaging rounds, uplink probes) under N Mbit/s, averaged "
    f"over a few seconds, so that the household's connection stays usable; 0: no cap; at least {MIN_CAP_MBIT:g}"
)


def parse_cap_mbit(text: str | float) -> float:
    """``--max-upload-mbit``'s value in Mbit/s: 0 for no cap, else at least ``MIN_CAP_MBIT``; ValueError says why."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number of Mbit/s") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a rate: give Mbit/s, or 0 for no cap")
    if 0 < value < MIN_CAP_MBIT:
        raise ValueError(
            f"{value:g} Mbit/s is below the {MIN_CAP_MBIT:g} Mbit/s a worker needs for its averaging rounds; "
            "give at least that, or 0 for no cap"
        )
    return value


def upload_cap_argument(text: str) -> float:
    """argparse's type for ``--max-upload-mbit``."""
    try:
        return parse_cap_mbit(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class UploadCap:
    """A token bucket of ``mbit`` Mbit/s shared by this process and the ones it forks after creating it."""

    def __init__(self, mbit: float, clock: Callable[[], float] = time.monotonic):
        mbit = parse_cap_mbit(mbit)
        if mbit == 0:
            raise ValueError("an upload cap of 0 is no cap: make no UploadCap")
        self.mbit, self.bytes_per_s = mbit, mbit * MBIT
        self.burst_bytes = self.bytes_per_s * BURST_S
        self._clock = clock  # CLOCK_MONOTONIC is one clock for all processes of the machine
        # tokens (starts full), when they were last counted, bytes paced so far
        self._state = mp.get_context("fork").Array("d", [self.burst_bytes, clock(), 0.0])

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` (charged with the wire's overhead) from the bucket; the seconds to wait before sending
        them. Reservations are served in order, so concurrent senders share the rate."""
        with self._state.get_lock():
            now = self._clock()
            earned = (now - self._state[_REFILLED]) * self.bytes_per_s
            tokens = min(self.burst_bytes, self._state[_TOKENS] + max(0.0, earned))
            tokens -= nbytes * WIRE_OVERHEAD
            self._state[_TOKENS], self._state[_REFILLED] = tokens, max(now, self._state[_REFILLED])
            self._state[_PACED] += nbytes
        return max(0.0, -tokens / self.bytes_per_s)

    @property
    def paced_bytes(self) -> int:
        """Bytes every sender of this worker has taken from the bucket so far (payload, without the overhead)."""
        with self._state.get_lock():
            return int(self._state[_PACED])

    def acquire(self, nbytes: int) -> None:
        """Wait (this thread) until ``nbytes`` may be sent."""
        time.sleep(self.reserve(nbytes))

    async def pace(self, nbytes: int) -> None:
        """Wait (this task) until ``nbytes`` may be sent."""
        await asyncio.sleep(self.reserve(nbytes))

    def limit(self, bytes_per_s: float) -> float:
        """A rate this worker may announce: ``bytes_per_s``, or the cap if that is lower."""
        return min(bytes_per_s, self.bytes_per_s)
