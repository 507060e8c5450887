"""Secret redaction by what secrets are, applied before anything is written to disk or shown.

What counts as a secret:

- a value we know (the user's token, passed in ``secrets``), wherever it appears;
- a Hugging Face token (``hf_`` and 12+ letters or digits, with a digit or capital among them),
  or an ``api_org_`` / ``hf_oauth_`` token;
- a private key (a PEM block labelled PRIVATE KEY);
- a bearer or authorization value (``Bearer x``, ``Authorization: x``);
- the value of a key *named* token, secret, password, key, ticket, cookie, credential or
  authorization (``HF_TOKEN=x``, ``"api_key": "x"``, ``private_key: x``), in text and in JSON.

Nothing else: a long file path, a timestamp or a flag such as ``hf_token_from_env`` is not a
secret and is kept as it is. libp2p peer ids (``12D3KooW...``) are public, so a bundle still
says who the peer was.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

REDACTED = "**REDACTED**"

# The last word of the key names what it holds: "hf_token", "API_KEY", "db-password"; not "hf_token_from_env".
_SECRET_NAME = r"(?:token|secret|passw(?:or)?d|key|ticket|cookie|credentials?|authorization)"
_SECRET_KEY = re.compile(rf"(?:^|[_.\-\s]){_SECRET_NAME}$|^{_SECRET_NAME}$", re.IGNORECASE)
_ASSIGNMENT = re.compile(
    rf"(?P<key>\b(?:[A-Za-z0-9_.\-]*[_.\-])?{_SECRET_NAME})\b(?P<sep>\"?\s*[=:]\s*)(?P<quote>[\"']?)(?P<value>[^\s\"',;]+)",
    re.IGNORECASE,
)
_PATTERNS = (
    re.compile(r"(?i)(?<=authorization)(\"?\s*[:=]\s*\"?)(?:[A-Za-z]+\s+)?[^\s\"',;]+"),
    re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL),
    re.compile(r"\bhf_(?=[A-Za-z0-9]*[0-9A-Z])[A-Za-z0-9]{12,}"),
    re.compile(r"\b(?:api_org|hf_oauth)_[A-Za-z0-9]{8,}"),
    re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=\-]{8,}"),
)
# Values that say whether or how much, never what: kept even under a secret-looking key.
_HARMLESS_VALUES = re.compile(r"^(?:true|false|none|null|yes|no|\d+(?:\.\d+)?)$", re.IGNORECASE)


def is_secret_key(key: str) -> bool:
    """A mapping key whose value is a secret (``hf_token``, ``api-key``), not one that merely mentions one."""
    return bool(_SECRET_KEY.search(key.strip()))


def _redact_assignment(match: re.Match[str]) -> str:
    if _HARMLESS_VALUES.match(match["value"]) or match["value"] == REDACTED:
        return match[0]
    return f"{match['key']}{match['sep']}{match['quote']}{REDACTED}"


def _redact_pattern_match(match: re.Match[str]) -> str:
    """A pattern's first group (what precedes the secret), if it has one, then REDACTED."""
    return f"{match[1] or ''}{REDACTED}" if match.re.groups else REDACTED


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Text with known secret values and every recognisable secret replaced by REDACTED."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    for pattern in _PATTERNS:
        text = pattern.sub(_redact_pattern_match, text)
    return _ASSIGNMENT.sub(_redact_assignment, text)


def redact_data(data: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of JSON-like data: string values under secret keys replaced, other strings redacted as text."""
    secrets = tuple(secrets)
    if isinstance(data, dict):
        return {
            key: REDACTED
            if is_secret_key(str(key)) and isinstance(value, str) and value
            else redact_data(value, secrets)
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
