"""A local stand-in for Hugging Face's whoami-v2 (its documented JSON), for the token-scope checks of the client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACCOUNT = {"type": "user", "name": "alice-hf", "fullname": "Alice"}
TOKENS = {
    "hf_readonly12345": {"role": "read", "displayName": "read"},
    "hf_write12345678": {"role": "write", "displayName": "write"},
    "hf_grainedwrite1": {
        "role": "fineGrained",
        "displayName": "grained",
        "fineGrained": {
            "global": ["discussion.write"],
            "scoped": [
                {"entity": {"type": "user", "name": "alice-hf"}, "permissions": ["repo.content.read", "repo.write"]}
            ],
        },
    },
    "hf_grainedread12": {
        "role": "fineGrained",
        "displayName": "no permission",
        "fineGrained": {"global": [], "scoped": [{"entity": {"type": "user"}, "permissions": ["repo.content.read"]}]},
    },
}


class WhoamiStandIn(BaseHTTPRequestHandler):
    def do_GET(self):
        token = TOKENS.get(self.headers.get("Authorization", "").removeprefix("Bearer "))
        if self.path != "/api/whoami-v2" or token is None:
            status, body = 401, {"error": "Invalid credentials in Authorization header"}
        else:
            status, body = 200, {**ACCOUNT, "auth": {"type": "access_token", "accessToken": token}}
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@contextmanager
def whoami_stand_in() -> Iterator[str]:
    """Serve the stand-in on a free loopback port; yields its URL (for HF_ENDPOINT)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), WhoamiStandIn)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
