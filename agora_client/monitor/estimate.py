"""The client's own points: a local estimate from its metrics, and the monitor's confirmed figures."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

import httpx

from agora_client.discovery.signed_records import MetricsRecord
from agora_client.events import PointsEvent
from agora_client.monitor.points import COMPUTE_PHASES, PFLOP, SECONDS_PER_HOUR


@dataclass(frozen=True)
class ConfirmedPoints:
    """This peer's points as the monitor credits them (PFLOPs); compute is verified: the claim as far as trainers'
    receipts vouch for it, and a claim past the receipts by more than the monitor's margin is flagged."""

    score: float
    verified_compute: float
    claimed_compute: float
    flagged: bool


def estimate_points(
    current: MetricsRecord,
    previous: MetricsRecord | None = None,
    *,
    confirmed: ConfirmedPoints | None = None,
    rank: tuple[int, int] | None = None,
    page_url: str | None = None,
) -> PointsEvent:
    """Presence and compute points of this peer alone (PFLOPs), as the monitor would credit them.

    ``rate_per_hour`` is measured between ``previous`` and ``current`` snapshots of the same run;
    without a usable previous snapshot it is the presence rate alone. The identity cap and other
    peers of the same identity are the monitor's business: ``confirmed`` carries its figures.
    """
    presence = current.active_seconds / SECONDS_PER_HOUR
    compute = current.compute_flops / PFLOP
    rate = 1.0  # every published phase earns presence: 1 PFLOP per hour
    if previous is not None and previous.run_id == current.run_id and current.ts > previous.ts:
        hours = (current.ts - previous.ts) / SECONDS_PER_HOUR
        gained = (current.active_seconds - previous.active_seconds) / SECONDS_PER_HOUR
        if current.sync_phase in COMPUTE_PHASES:
            gained += (current.compute_flops - previous.compute_flops) / PFLOP
        rate = max(0.0, gained / hours)
    place, ranked = rank if rank is not None else (None, None)
    monitor = (
        {}
        if confirmed is None
        else {
            "confirmed": confirmed.score,
            "verified_compute": confirmed.verified_compute,
            "claimed_compute": confirmed.claimed_compute,
            "flagged": confirmed.flagged,
        }
    )
    return PointsEvent(
        presence=presence,
        compute=compute,
        rate_per_hour=rate,
        rank=place,
        ranked=ranked,
        page_url=page_url,
        **monitor,
    )


def fetch_confirmed(monitor_url: str, peer_id: str, *, timeout: float = 5.0) -> ConfirmedPoints | None:
    """This peer's points as the monitor confirmed them, or None when the monitor is unreachable or does not know it."""
    url = f"{monitor_url.rstrip('/')}/peers/{quote(peer_id, safe='')}"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        peer = response.json()
        return ConfirmedPoints(
            score=float(peer["score"]),
            verified_compute=float(peer["compute"]),
            claimed_compute=float(peer["claimed_compute"]),
            flagged=bool(peer["flagged"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


def fetch_rank(monitor_url: str, identity: str, *, timeout: float = 5.0) -> tuple[int, int] | None:
    """(place, contributors) of this identity on the monitor's leaderboard.

    None if it is not listed or unreachable."""
    try:
        response = httpx.get(f"{monitor_url.rstrip('/')}/leaderboard", timeout=timeout)
        rows = response.json()["rows"] if response.status_code == 200 else []
        place = next((int(row["rank"]) for row in rows if row.get("username") == identity), None)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return None if place is None else (place, len(rows))
