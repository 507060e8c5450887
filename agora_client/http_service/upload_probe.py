"""An upload probe: the service reads a client's body and drops it, timing its arrival, so the client learns its uplink.

The client cannot time its own upload: its writes return once the bytes are in its socket's send buffer (megabytes
on a fast host), long before they have crossed its uplink. The service sees them arrive. It answers how many bytes
came after the first chunk and over how many seconds (the first chunk's arrival starts the clock, so connection
setup and the client's first write are not counted).
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

from aiohttp import web

from .messages import json_reply

UPLOAD_PROBE_MAX_BYTES = 16 << 20  # a probe's body is read up to this (a few seconds of a fast home uplink) and dropped


async def measure_upload(request: web.BaseRequest, timeout_s: float) -> tuple[HTTPStatus, dict]:
    """(status, JSON) for an upload probe: ``received``, ``timed_bytes`` and ``seconds``, or an ``error``."""
    received, timed_bytes, first_at, last_at = 0, 0, None, None
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                now = time.monotonic()
                received += len(chunk)
                if first_at is None:
                    first_at = now
                else:
                    timed_bytes += len(chunk)
                last_at = now
                if received > UPLOAD_PROBE_MAX_BYTES:
                    return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {
                        "error": f"an upload probe is at most {UPLOAD_PROBE_MAX_BYTES} bytes"
                    }
    except TimeoutError:
        return HTTPStatus.REQUEST_TIMEOUT, {"error": f"an upload probe must end within {timeout_s:g} s"}
    seconds = (last_at - first_at) if first_at is not None and last_at is not None else 0.0
    return HTTPStatus.OK, {"received": received, "timed_bytes": timed_bytes, "seconds": seconds}


def probe_response(status: HTTPStatus, payload: dict, headers: dict[str, str]) -> web.Response:
    reply = json_reply(status, {"status": "ok" if status == HTTPStatus.OK else "error", **payload}, headers)
    response = web.Response(status=reply.status, body=reply.body, headers=reply.headers)
    if status != HTTPStatus.OK:  # a half-read body must not be taken for the next request
        response.force_close()
    return response
