"""What a worker served and what it moved over the network, counted where it happens.

Requests are counted in the connection handlers, one per trainer request, after it was answered
(hivemind's runtime may merge several requests into one batch, so the backend cannot count them).
The handlers are forked processes, so the counters live in shared memory created before the fork.
SPARTA rounds add the bytes of their averaging messages. ``TrafficWindow`` turns the running
totals into per-minute and per-second rates for the front end.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal

from agora_client.events import TrafficEvent

RequestKind = Literal["forward", "backward"]
_FIELDS = ("forward", "backward", "bytes_in", "bytes_out")


@dataclass(frozen=True)
class MeterTotals:
    forward: int = 0
    backward: int = 0
    bytes_in: int = 0  # payload bytes received (requests, SPARTA messages)
    bytes_out: int = 0  # payload bytes sent (replies, SPARTA messages)


class RequestMeter:
    """Running totals shared by the worker and its forked connection handlers (create it before they start)."""

    def __init__(self) -> None:
        self._values = mp.Array("q", len(_FIELDS))  # one lock for all four: a reader never sees half an update

    def _add(self, **amounts: int) -> None:
        with self._values.get_lock():
            for name, amount in amounts.items():
                self._values[_FIELDS.index(name)] += amount

    def on_request(self, kind: RequestKind, bytes_in: int, bytes_out: int) -> None:
        """One answered trainer request and its payload sizes."""
        if kind == "forward":
            self._add(forward=1, bytes_in=bytes_in, bytes_out=bytes_out)
        else:
            self._add(backward=1, bytes_in=bytes_in, bytes_out=bytes_out)

    def on_transfer(self, sent: int, received: int) -> None:
        """Bytes moved outside requests (a SPARTA round's averaging messages)."""
        self._add(bytes_in=received, bytes_out=sent)

    def totals(self) -> MeterTotals:
        with self._values.get_lock():
            return MeterTotals(*self._values[:])


class TrafficWindow:
    """Rates over the last ``window_s`` seconds from successive totals, beside the upload cap (bytes/s) and the
    uplink the worker announces (``announced_uplink``), where it has them."""

    def __init__(
        self,
        meter: RequestMeter,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        upload_cap_bps: float | None = None,
        announced_uplink: Callable[[], float] | None = None,
    ) -> None:
        self.meter, self.window_s, self._clock = meter, window_s, clock
        self.upload_cap_bps, self._announced_uplink = upload_cap_bps, announced_uplink
        self._samples: deque[tuple[float, MeterTotals]] = deque([(clock(), meter.totals())])

    def sample(self) -> TrafficEvent:
        now, totals = self._clock(), self.meter.totals()
        self._samples.append((now, totals))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        since, before = self._samples[0]
        seconds = max(now - since, 1e-6)
        return TrafficEvent(
            forward_per_min=round((totals.forward - before.forward) * 60 / seconds, 2),
            backward_per_min=round((totals.backward - before.backward) * 60 / seconds, 2),
            upload_bps=round((totals.bytes_out - before.bytes_out) / seconds, 1),
            download_bps=round((totals.bytes_in - before.bytes_in) / seconds, 1),
            forward_total=totals.forward,
            backward_total=totals.backward,
            bytes_sent=totals.bytes_out,
            bytes_received=totals.bytes_in,
            window_s=round(seconds, 2),
            upload_cap_bps=self.upload_cap_bps,
            announced_uplink_bps=None if self._announced_uplink is None else round(self._announced_uplink(), 1),
        )
