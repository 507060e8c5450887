"""What a synchronous handler receives and returns."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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


def json_reply(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(
        int(status), json.dumps(payload).encode("utf-8"), {"Content-Type": "application/json", **(headers or {})}
    )
