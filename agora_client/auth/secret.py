"""A wrapper that keeps a token out of reprs, f-strings, logs and tracebacks, and token hashing."""

from __future__ import annotations

import hashlib
import hmac


class Secret:
    """Holds a secret string; only ``reveal()`` returns it, every printable form is redacted."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        if isinstance(value, Secret):
            value = value.reveal()
        if not isinstance(value, str):
            raise TypeError("a Secret holds a str")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**REDACTED**')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce__(self):
        raise TypeError("a Secret cannot be pickled")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash(("Secret", hashlib.sha256(self._value.encode()).digest()))

    def __bool__(self) -> bool:
        return bool(self._value)


def token_digest(key: bytes, token: Secret) -> str:
    """Keyed (salted) hash of a token: what the service keeps instead of the token itself."""
    return hmac.new(key, token.reveal().encode("utf-8"), hashlib.sha256).hexdigest()


def token_fingerprint(token: Secret) -> str:
    """Unkeyed sha256 of a token, used in token files; tokens are random, so it cannot be reversed."""
    return hashlib.sha256(token.reveal().encode("utf-8")).hexdigest()
