"""The monitor's read-only HTTP API (JSON).

  GET /leaderboard       -> {"generated_at": ts, "rows": [{rank, username, active_hours, joined, score, online,
                            flagged}]}: ranked by verified points; flagged: a peer claims more than receipted
  GET /peers/<peer_id>   -> that peer's confirmed points: {peer_id, identity, stage, sync_phase, presence,
                            compute, claimed_compute, flagged, withheld, withheld_compute, unpaid_compute, score,
                            online, first_seen, last_seen}; 404 if the monitor never verified it. compute is
                            verified (claimed_compute as far as trainers' receipts vouch for it); unpaid_compute:
                            receipted compute the trainers' escrow holds or forfeited (trainer/escrow.py). A peer a
                            trainer caught lying is withheld: compute 0, its credited compute shown as withheld_compute
  GET /learning          -> {"loss": [[ts, loss], ...], "eval_loss": [[ts, eval loss], ...]}: the swarm's learning
                            curve, every point the trainers' progress records carried since the monitor's first
                            scrape, all trainers merged, oldest first (eval_loss: the held-out evaluations)
  GET /health            -> {"status": "ok", "peers": n}
  GET /swarm             -> the run's name and model, contributors (online), escrow (held, forfeited, disputed_windows)
                            and the latest scrape's summary: tokens/s, tokens seen, per stage workers active /
                            syncing / queued, SPARTA success, spot checks
  GET /identities/<name> -> one contributor: standing, peers, withheld compute and why, points over time; 404 if unknown
  GET /metrics           -> Prometheus text for operators: points, contributors, the swarm (operator_metrics.py)
The public page (agora_client/monitor/page): GET / (the swarm), GET /contributors/<name> (one contributor), and its
files under GET /static/; it polls the JSON above.
Scores are in PFLOPs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

from agora_client.http_service import PLAIN_HTTP, Exposure, HttpService, Reply, Request, ServiceLimits, json_reply
from agora_client.monitor.operator_metrics import monitor_collector
from agora_client.monitor.page import PageFiles, RunInfo, contributor_name, contributor_view, swarm_view
from agora_client.monitor.points import PFLOP, PeerState
from agora_client.monitor.store import PointsStore
from agora_client.operator_metrics import METRICS_PATH, http_front_collector, metrics_reply, new_registry

log = logging.getLogger(__name__)

MONITOR_LIMITS = ServiceLimits(max_body_bytes=0)  # a read-only API: requests carry no body


def peer_points(peer: PeerState, now: float, store: PointsStore) -> dict[str, Any]:
    return {
        "peer_id": peer.peer_id,
        "identity": peer.identity,
        "stage": peer.stage,
        "sync_phase": peer.sync_phase,
        "presence": peer.presence_points,
        "compute": peer.compute_points,
        "claimed_compute": peer.claimed_points,
        "flagged": peer.over_claimed(store.policy),
        "withheld": peer.withheld,
        "withheld_compute": peer.compute_flops / PFLOP if peer.withheld else 0.0,
        "unpaid_compute": peer.unpaid_flops / PFLOP,
        "score": peer.score,
        "online": peer.online(now, store.policy),
        "first_seen": peer.first_seen,
        "last_seen": peer.last_seen,
    }


class LeaderboardServer:
    """Serves the store's leaderboard on the guarded HTTP front (``agora_client.http_service``); ``url`` is its base
    address. Bound on construction, serving after ``start()``; ``exposure``: TLS and trusted reverse proxies."""

    def __init__(
        self,
        store: PointsStore,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Callable[[], float] = time.time,
        limits: ServiceLimits = MONITOR_LIMITS,
        run: RunInfo | None = None,
        exposure: Exposure = PLAIN_HTTP,
    ):
        self.store, self.clock, self.run = store, clock, run
        self._page = PageFiles()
        self._http = HttpService(self._answer, host, port, name="leaderboard-http", limits=limits, exposure=exposure)
        self._metrics = new_registry(monitor_collector(store, clock), http_front_collector(self._http))

    @property
    def url(self) -> str:
        return self._http.url

    def start(self) -> "LeaderboardServer":
        self._http.start()
        return self

    def stop(self) -> None:
        self._http.close()

    def server_close(self) -> None:
        """Release the port of a server that was never started."""
        self._http.close()

    def _answer(self, request: Request) -> Reply:
        path = request.path.rstrip("/") or "/"
        if request.method != "GET":
            return json_reply(
                HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {request.method} {path}; try GET /leaderboard"}
            )
        store, now = self.store, self.clock()
        try:
            if path == "/leaderboard":
                rows = [dataclasses.asdict(row) for row in store.leaderboard(now)]
                return json_reply(HTTPStatus.OK, {"generated_at": now, "rows": rows})
            if path.startswith("/peers/") and path.count("/") == 2:
                peer_id = unquote(path.removeprefix("/peers/"))
                peer = store.peer(peer_id)
                if peer is None:
                    return json_reply(HTTPStatus.NOT_FOUND, {"error": f"no verified metrics from peer {peer_id} yet"})
                return json_reply(HTTPStatus.OK, peer_points(peer, now, store))
            if path == "/learning":
                return json_reply(HTTPStatus.OK, store.learning())
            if path == "/health":
                return json_reply(HTTPStatus.OK, {"status": "ok", "peers": len(store.peers())})
            if path == METRICS_PATH:
                return metrics_reply(self._metrics)
            page = self._page_reply(request, path, now)
            if page is not None:
                return page
            return json_reply(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: GET {path}; try /leaderboard"})
        except Exception:  # the service keeps running; the client gets one line, the log the traceback
            log.exception("internal error answering GET %s", path)
            return json_reply(
                HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error in the monitor; try again later"}
            )

    def _page_reply(self, request: Request, path: str, now: float) -> Reply | None:
        """The public page's files and JSON views; None for a path that is none of them."""
        if path == "/":
            return self._page.html("index.html")
        if path == "/swarm":
            return json_reply(HTTPStatus.OK, swarm_view(self.store, self.run, now))
        if path.startswith("/static/"):
            return self._page.static(path)
        if (name := contributor_name(request.target, "/contributors/")) is not None:
            known = any(row.username == name for row in self.store.leaderboard(now))
            return self._page.html("contributor.html", HTTPStatus.OK if known else HTTPStatus.NOT_FOUND)
        if (name := contributor_name(request.target, "/identities/")) is not None:
            view = contributor_view(self.store, name, now)
            if view is None:
                return json_reply(HTTPStatus.NOT_FOUND, {"error": f"no verified metrics from a peer of {name} yet"})
            return json_reply(HTTPStatus.OK, view)
        return None
