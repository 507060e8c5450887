"""A trainer's series for operators: microbatches done, requests per stage and how they failed, bans, workers
routable, and its spot checks. Read at every scrape from the router's balancers, the training loop's count and
the spot checker's report."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agora_client.operator_metrics import Series, SeriesCollector, Values

if TYPE_CHECKING:
    from agora_client.trainer.balancer import Router
    from agora_client.trainer.spotcheck import SpotChecker

MICROBATCHES = Series("agora_trainer_microbatches", "counter", "microbatches that went through the whole pipeline")
REQUESTS = Series("agora_trainer_rpc_requests", "counter", "stage requests workers answered", ("stage",))
ERRORS = Series(
    "agora_trainer_rpc_errors",
    "counter",
    "stage requests that failed: retried (timeout, worker unreachable) or rejected (not worth retrying)",
    ("stage", "outcome"),
)
BANS = Series("agora_trainer_worker_bans", "counter", "times a worker of the stage was banned from routing", ("stage",))
WORKERS = Series(
    "agora_trainer_workers",
    "gauge",
    "the stage's workers as this trainer routes: ready, syncing (phase 1, skipped) or banned",
    ("stage", "state"),
)
IN_FLIGHT = Series("agora_trainer_requests_in_flight", "gauge", "requests waiting for a worker's answer", ("stage",))
SPOT_CHECKS = Series(
    "agora_trainer_spot_checks", "counter", "spot checks and what they gave: checks, strikes, bans", ("stage", "event")
)
SERIES = (MICROBATCHES, REQUESTS, ERRORS, BANS, WORKERS, IN_FLIGHT, SPOT_CHECKS)


def trainer_collector(
    router: Router, microbatches: Callable[[], int], spot_checks: SpotChecker | None
) -> SeriesCollector:
    def read() -> dict[str, Values]:
        stats = router.stats()
        values: dict[str, Values] = {
            MICROBATCHES.name: microbatches(),
            REQUESTS.name: {stage: item.done for stage, item in stats.items()},
            ERRORS.name: {
                **{(stage, "retried"): item.retries for stage, item in stats.items()},
                **{(stage, "rejected"): item.rejected for stage, item in stats.items()},
            },
            BANS.name: {stage: item.bans for stage, item in stats.items()},
            WORKERS.name: {
                (stage, state): getattr(item, state)
                for stage, item in stats.items()
                for state in ("ready", "syncing", "banned")
            },
            IN_FLIGHT.name: {stage: item.in_flight for stage, item in stats.items()},
        }
        if spot_checks is not None:
            values[SPOT_CHECKS.name] = {
                (stage, event): getattr(report, event)
                for stage, report in spot_checks.report().items()
                for event in ("checks", "strikes", "bans")
            }
        return values

    return SeriesCollector(SERIES, read)
