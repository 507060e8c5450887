"""What the auth service says of the swarm, from its ``/v1/status``: joiners waiting per stage (the public page) and
the peers holding a slot per stage (presence is earned only while holding one, monitor/points.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AuthView:
    queued: dict[str, int]
    holders: dict[str, frozenset[str]] | None  # None: a service that does not list them


def fetch_auth_view(auth_url: str) -> AuthView | None:
    """None (logged at debug level) if the service cannot say."""
    url = f"{auth_url.rstrip('/')}/v1/status"
    try:
        response = httpx.get(url, timeout=STATUS_TIMEOUT_S)
        response.raise_for_status()
        status = response.json()
        queued = {stage: int(figures["queued"]) for stage, figures in status["stages"].items()}
        listed = status.get("holders")
        holders = (
            {str(stage): frozenset(map(str, peers)) for stage, peers in listed.items()}
            if isinstance(listed, dict)
            else None
        )
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.debug("nothing from the auth service at %s: %s", url, error)
        return None
    return AuthView(queued, holders)
