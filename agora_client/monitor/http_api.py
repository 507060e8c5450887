"""The monitor's read-only HTTP API (JSON).

  GET /leaderboard       -> {"generated_at": ts, "rows": [{rank, username, active_hours, joined, score, online}]}
  GET /peers/<peer_id>   -> that peer's confirmed points: {peer_id, identity, stage, sync_phase, presence,
                            compute, withheld, withheld_compute, score, online, first_seen, last_seen}; 404 if the
                            monitor never verified it. A peer a trainer caught lying is withheld: compute 0, its
                            credited compute shown as withheld_compute
  GET /learning          -> {"loss": [[ts, loss], ...], "eval_loss": [[ts, eval loss], ...]}: the swarm's learning
                            curve, every point the trainers' progress records carried since the monitor's first
                            scrape, all trainers merged, oldest first (eval_loss: the held-out evaluations)
  GET /health            -> {"status": "ok", "peers": n}
Scores are in PFLOPs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

from agora_client.monitor.points import PFLOP, PeerState
from agora_client.monitor.store import PointsStore

log = logging.getLogger(__name__)


def peer_points(peer: PeerState, now: float, store: PointsStore) -> dict[str, Any]:
    return {
        "peer_id": peer.peer_id,
        "identity": peer.identity,
        "stage": peer.stage,
        "sync_phase": peer.sync_phase,
        "presence": peer.presence_points,
        "compute": peer.compute_points,
        "withheld": peer.withheld,
        "withheld_compute": peer.compute_flops / PFLOP if peer.withheld else 0.0,
        "score": peer.score,
        "online": peer.online(now, store.policy),
        "first_seen": peer.first_seen,
        "last_seen": peer.last_seen,
    }


class _Handler(BaseHTTPRequestHandler):
    server: "LeaderboardServer"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        store, now = self.server.store, self.server.clock()
        try:
            if path == "/leaderboard":
                rows = [dataclasses.asdict(row) for row in store.leaderboard(now)]
                self._reply(HTTPStatus.OK, {"generated_at": now, "rows": rows})
            elif path.startswith("/peers/") and path.count("/") == 2:
                peer_id = unquote(path.removeprefix("/peers/"))
                peer = store.peer(peer_id)
                if peer is None:
                    self._reply(HTTPStatus.NOT_FOUND, {"error": f"no verified metrics from peer {peer_id} yet"})
                else:
                    self._reply(HTTPStatus.OK, peer_points(peer, now, store))
            elif path == "/learning":
                self._reply(HTTPStatus.OK, store.learning())
            elif path == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok", "peers": len(store.peers())})
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: GET {path}; try /leaderboard"})
        except Exception:  # the service keeps running; the client gets one line, the log the traceback
            log.exception("internal error answering GET %s", path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error in the monitor; try again later"})

    def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class LeaderboardServer(ThreadingHTTPServer):
    """Serves the store's leaderboard from a background thread; ``url`` is its base address."""

    daemon_threads = True

    def __init__(self, store: PointsStore, host: str = "127.0.0.1", port: int = 0, *, clock: Callable[[], float] = time.time):
        super().__init__((host, port), _Handler)
        self.store, self.clock = store, clock
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "LeaderboardServer":
        self._thread = threading.Thread(target=self.serve_forever, name="leaderboard-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
