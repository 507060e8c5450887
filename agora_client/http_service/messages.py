"""What a synchronous handler receives and returns."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    """The path without its query string."""
    target: str
    """The path as sent, query string included."""
    headers: Mapping[str, str]
    """Case-insensitive."""
    body: bytes
    source: str
    """The client's address (what the auth service dials back): behind a trusted proxy, the one it forwarded for."""


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    stream: Callable[[BinaryIO], None] | None = None
    """Writes the body in a handler thread instead of ``body`` (headers must then give its Content-Length);
    raising from it cuts the connection."""


def json_reply(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(
        int(status), json.dumps(payload).encode("utf-8"), {"Content-Type": "application/json", **(headers or {})}
    )
