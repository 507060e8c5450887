"""The page's files, read once from this package, and the headers they are served with.

The policy allows scripts, styles, images and API calls from the monitor itself only, and no inline script or style:
an attacker-chosen user name that slipped into the DOM as markup still could not run.
"""

from __future__ import annotations

from http import HTTPStatus
from importlib import resources
from urllib.parse import unquote

from agora_client.http_service import Reply

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
STATIC_PREFIX = "/static/"
CONTRIBUTORS_PREFIX = "/contributors/"
STATIC_MAX_AGE_S = 60


class PageFiles:
    """Every file under ``static/``, in memory (a few tens of kB): nothing on disk is opened per request."""

    def __init__(self) -> None:
        folder = resources.files(__package__) / "static"
        self._files = {
            entry.name: entry.read_bytes()
            for entry in folder.iterdir()
            if entry.is_file() and any(entry.name.endswith(suffix) for suffix in CONTENT_TYPES)
        }

    def html(self, name: str, status: int = HTTPStatus.OK) -> Reply:
        return self._reply(name, status, "no-cache")

    def static(self, path: str) -> Reply | None:
        """The file ``/static/<name>`` asks for; None if there is no such file."""
        name = path.removeprefix(STATIC_PREFIX)
        if name not in self._files:
            return None
        return self._reply(name, HTTPStatus.OK, f"max-age={STATIC_MAX_AGE_S}")

    def _reply(self, name: str, status: int, cache: str) -> Reply:
        content_type = next(kind for suffix, kind in CONTENT_TYPES.items() if name.endswith(suffix))
        headers = {**SECURITY_HEADERS, "Content-Type": content_type, "Cache-Control": cache}
        return Reply(int(status), self._files[name], headers)


def contributor_name(target: str, prefix: str) -> str | None:
    """The name in ``<prefix><name>`` of a request target as sent (a name may hold an escaped ``/``); None otherwise."""
    raw = target.split("?", 1)[0]
    if not raw.startswith(prefix) or "/" in raw.removeprefix(prefix) or raw == prefix:
        return None
    return unquote(raw.removeprefix(prefix))
