"""The contributor's side of the auth service's upload probe: how fast this machine's uplink moves bytes to the swarm.

The service times the bytes as they arrive and drops them (agora_client/http_service/upload_probe.py); the client
sends incompressible bytes for at most ``max_s`` or ``max_bytes``, whichever comes first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

UPLOAD_PROBE_PATH = "/v1/probe/upload"
CHUNK_BYTES = 64 << 10


class UplinkProbeFailed(Exception):
    pass


@dataclass(frozen=True)
class UplinkMeasurement:
    bytes_per_s: float
    received: int  # bytes the service read


def _body(max_bytes: int, max_s: float) -> Iterator[bytes]:
    chunk, sent, started = os.urandom(CHUNK_BYTES), 0, time.monotonic()
    while sent < max_bytes and time.monotonic() - started < max_s:
        yield chunk
        sent += len(chunk)


def measure_uplink(
    swarm_url: str, *, max_bytes: int = 8 << 20, max_s: float = 3.0, client: httpx.Client | None = None
) -> UplinkMeasurement:
    """Send up to ``max_bytes`` for at most ``max_s`` to the auth service; UplinkProbeFailed says why it could not."""
    http = client or httpx.Client(timeout=max_s + 15.0)
    try:
        response = http.post(f"{swarm_url.rstrip('/')}{UPLOAD_PROBE_PATH}", content=_body(max_bytes, max_s))
        answer = response.json()
        if response.status_code != 200:
            raise UplinkProbeFailed(f"the auth service answered {response.status_code}: {answer.get('error', '')}")
        seconds, timed = float(answer["seconds"]), int(answer["timed_bytes"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UplinkProbeFailed(f"could not send to the auth service ({type(error).__name__})") from None
    finally:
        if client is None:
            http.close()
    if seconds <= 0 or timed <= 0:
        raise UplinkProbeFailed("too few bytes reached the auth service to time them")
    return UplinkMeasurement(timed / seconds, int(answer["received"]))
