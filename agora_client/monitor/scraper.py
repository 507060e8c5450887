"""One scrape: read the stages' metrics records from the DHT, keep the verified ones, credit them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hivemind import DHT

from agora_client.monitor.points import Observation, PeerState
from agora_client.monitor.records import VerifiedRecord, fetch_metrics
from agora_client.monitor.store import PointsStore

log = logging.getLogger(__name__)


def observation_of(verified: VerifiedRecord, seen_at: float) -> Observation:
    record = verified.record
    return Observation(
        peer_id=record.peer_id,
        identity=verified.claims.identity,
        stage=record.stage,
        run_id=record.run_id,
        sync_phase=record.sync_phase,
        active_seconds=record.active_seconds,
        compute_flops=record.compute_flops,
        seen_at=seen_at,
    )


class Scraper:
    """Reads ``agora.metrics.<stage>`` for every stage and records what verifies in the store."""

    def __init__(
        self,
        dht: DHT,
        stages: Sequence[str],
        store: PointsStore,
        auth_public_key: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dht, self.stages, self.store = dht, tuple(stages), store
        self.auth_public_key = auth_public_key
        self.clock = clock
        self._reported: set[str] = set()  # reject reasons already logged, so a replayed forgery logs once

    def _reject(self, reason: str) -> None:
        if reason not in self._reported:
            self._reported.add(reason)
            log.warning("ignored metrics record: %s", reason)

    def scrape_once(self) -> dict[str, PeerState]:
        now = self.clock()
        verified = fetch_metrics(self.dht, self.stages, self.auth_public_key, now=now, on_reject=self._reject)
        observations = [observation_of(item, now) for item in verified]
        records = {item.record.peer_id: item.record.model_dump_json(exclude={"ticket"}) for item in verified}
        return self.store.record_scrape(observations, records, now)
