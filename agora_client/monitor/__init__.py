"""Metrics -> points -> leaderboard.

Workers: ``WorkerMetrics`` (agora_client.worker.metrics) counts, ``publish_metrics`` signs and stores.
Monitor: ``Scraper`` + ``PointsStore`` + ``LeaderboardServer``.
Client: ``estimate_points``, ``fetch_confirmed``, ``fetch_rank``.
Names that need hivemind or the auth package are imported on first use, so that the light
parts (points, FLOPs, the leaderboard table) load without them.
"""

from importlib import import_module
from typing import Any

from agora_client.monitor.flops import backward_flops, forward_flops, request_flops, stage_matmuls
from agora_client.monitor.points import (
    PFLOP,
    LeaderboardRow,
    Observation,
    PeerState,
    PointsPolicy,
    apply_observations,
    leaderboard,
)
from agora_client.monitor.store import PointsStore

_LAZY = {
    "MetricsRecord": "agora_client.discovery.signed_records",
    "VerifiedRecord": "agora_client.monitor.records",
    "publish_metrics": "agora_client.monitor.records",
    "fetch_metrics": "agora_client.monitor.records",
    "metrics_key": "agora_client.discovery.signed_records",
    "signed_dht_kwargs": "agora_client.monitor.records",
    "create_signed_dht": "agora_client.monitor.records",
    "estimate_points": "agora_client.monitor.estimate",
    "fetch_confirmed": "agora_client.monitor.estimate",
    "fetch_rank": "agora_client.monitor.estimate",
    "Scraper": "agora_client.monitor.scraper",
    "LeaderboardServer": "agora_client.monitor.http_api",
}

__all__ = [
    "PFLOP",
    "LeaderboardRow",
    "Observation",
    "PeerState",
    "PointsPolicy",
    "PointsStore",
    "apply_observations",
    "backward_flops",
    "forward_flops",
    "leaderboard",
    "request_flops",
    "stage_matmuls",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agora_client.monitor' has no attribute {name!r}")
