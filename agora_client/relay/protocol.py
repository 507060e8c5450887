"""The relay's wire format: one JSON object per line, each line at most ``MAX_LINE`` bytes.

Requests (worker -> relay) carry ``"v": VERSION``; the relay's messages (``ok``/``error`` answers, ``connect``,
``ping``) do not. See the package docstring for the conversation. A ``reserve`` may name the ``port`` it held
before (its worker announced that address): the relay gives it back if it is free, and keeps a released port
for a while for the request that names it.
"""

from __future__ import annotations

import json

VERSION = 1
MAX_LINE = 4096  # bytes, newline included


class ProtocolError(ValueError):
    """A line that is not a valid relay message; its text says what was wrong, in plain words."""


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict:
    """The message on one line (its newline optional); ProtocolError for anything else."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line longer than {MAX_LINE} bytes; send one short JSON object per line")
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ProtocolError(
            'not JSON; send one JSON object per line, e.g. {"v":1,"op":"reserve","peer_id":"..."}'
        ) from None
    if not isinstance(message, dict):
        raise ProtocolError("not a relay message: expected a JSON object")
    return message


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(text: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) -> (host, port); ValueError saying what is expected."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not an address: expected host:port, e.g. relay.example.org:7070")
    return host, int(port)
