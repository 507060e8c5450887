"""Secret redaction, by key and by token pattern, applied before anything is written to disk.

By key: any mapping key that names a secret (token, secret, password, key, authorization...)
has its value replaced by ``**REDACTED**``; so does ``KEY=value`` text. By pattern: Hugging Face
tokens, bearer tokens, PEM blocks, ed25519 / ssh keys and long base64-like strings. libp2p peer
ids (``12D3KooW...``, ``Qm...``) are public and kept, so a bundle still says who the peer was.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

REDACTED = "**REDACTED**"

_SECRET_KEY = re.compile(
    r"token|secret|passw(or)?d|api[_-]?key|private[_-]?key|priv[_-]?key|authorization|credential|signature|ticket|cookie|^key$",
    re.IGNORECASE,
)
_ASSIGNMENT = re.compile(
    r"(?P<key>\b[A-Za-z0-9_.-]*(?:TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_?KEY|AUTHORIZATION|CREDENTIAL)[A-Za-z0-9_.-]*)"
    r"(?P<sep>\s*[=:]\s*)(?P<quote>[\"']?)(?P<value>[^\s\"',;]+)",
    re.IGNORECASE,
)
_PATTERNS = (
    re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|\Z)", re.DOTALL),
    re.compile(r"\bhf_[A-Za-z0-9]{8,}"),
    re.compile(r"\b(?:api_org|hf_oauth)_[A-Za-z0-9]{8,}"),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\bssh-ed25519\s+[A-Za-z0-9+/=]{16,}"),
    re.compile(r"(?i)\bed25519[:=]\s*[A-Za-z0-9+/=_-]{16,}"),
)
# Long base64/hex-like runs that mix letters and digits; public peer ids are excluded.
_LONG_SECRET = re.compile(r"(?<![A-Za-z0-9+/_-])(?!12D3KooW|Qm)(?=[A-Za-z0-9+/=_-]*[0-9])(?=[A-Za-z0-9+/=_-]*[A-Za-z])[A-Za-z0-9+/_-]{40,}={0,2}")


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Text with known secret values and every secret-shaped run replaced by REDACTED."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(REDACTED, text)
    text = _ASSIGNMENT.sub(lambda m: f"{m['key']}{m['sep']}{m['quote']}{REDACTED}", text)
    return _LONG_SECRET.sub(REDACTED, text)


def redact_data(data: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of JSON-like data: values under secret keys replaced, strings redacted by pattern."""
    secrets = tuple(secrets)
    if isinstance(data, dict):
        return {
            key: REDACTED if is_secret_key(str(key)) and value not in (None, "") else redact_data(value, secrets)
            for key, value in data.items()
        }
    if isinstance(data, (list, tuple)):
        return [redact_data(item, secrets) for item in data]
    if isinstance(data, str):
        return redact_text(data, secrets)
    return data


def redact_line(line: str, secrets: Iterable[str] = ()) -> str:
    """One log line: JSON lines are redacted structurally (by key), anything else as text."""
    stripped = line.strip()
    if stripped.startswith("{"):
        try:
            return json.dumps(redact_data(json.loads(stripped), secrets), separators=(",", ":"))
        except json.JSONDecodeError:
            pass
    return redact_text(line.rstrip("\n"), secrets)
