"""One scrape: read the stages' metrics records from the DHT, keep the verified ones, credit them as far as
ticketed trainers' receipts vouch for them (a claim far over its receipts is logged once); withhold the
compute points of workers that a ticketed trainer's verdict names; keep the points of the trainers' loss and
eval-loss curves from their progress records; and the swarm's summary for the public page (monitor/swarm_summary.py),
with the auth service's queue lengths when the monitor knows its URL."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hivemind import DHT

from agora_client.discovery.progress_records import fetch_progress
from agora_client.monitor.learning import learning_points
from agora_client.monitor.points import Observation, PeerState
from agora_client.monitor.receipts import fetch_receipts
from agora_client.monitor.records import VerifiedRecord, fetch_metrics
from agora_client.monitor.store import PointsStore
from agora_client.monitor.swarm_summary import TokenTally, fetch_queued, summarize
from agora_client.monitor.verdicts import fetch_verdicts

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
    """Reads ``agora.metrics.<stage>`` for every stage and records what verifies in the store, and the
    trainers' ``agora.trainers`` progress records for the learning curve."""

    def __init__(
        self,
        dht: DHT,
        stages: Sequence[str],
        store: PointsStore,
        auth_public_key: str,
        *,
        clock: Callable[[], float] = time.time,
        auth_url: str | None = None,
    ) -> None:
        self.dht, self.stages, self.store = dht, tuple(stages), store
        self.auth_public_key = auth_public_key
        self.clock = clock
        self.auth_url = auth_url
        self._tokens = TokenTally()
        self._reported: set[str] = set()  # reject reasons already logged, so a replayed forgery logs once
        self._flagged: set[str] = set()  # peers whose over-claim was logged

    def _reject(self, reason: str) -> None:
        if reason not in self._reported:
            self._reported.add(reason)
            log.warning("ignored record: %s", reason)

    def scrape_once(self) -> dict[str, PeerState]:
        now = self.clock()
        for verdict in fetch_verdicts(self.dht, self.auth_public_key, now=now, on_reject=self._reject):
            reason = (
                f"trainer {verdict.trainer}: {verdict.uid} disagreed with its stage "
                f"{verdict.disagreements} times in {verdict.checks} spot checks"
            )
            if self.store.withhold(verdict.peer_id, reason, now):
                log.warning("withholding the compute points of peer %s (%s)", verdict.peer_id, reason)
        self.store.record_receipts(fetch_receipts(self.dht, self.auth_public_key, now=now, on_reject=self._reject))
        verified = fetch_metrics(self.dht, self.stages, self.auth_public_key, now=now, on_reject=self._reject)
        observations = [observation_of(item, now) for item in verified]
        records = {item.record.peer_id: item.record.model_dump_json(exclude={"ticket"}) for item in verified}
        updated = self.store.record_scrape(observations, records, now)
        progress = fetch_progress(self.dht)
        self.store.record_learning(learning_points(progress))
        queued = fetch_queued(self.auth_url) if self.auth_url else None
        self.store.set_summary(
            summarize(self.stages, [item.record for item in verified], progress, queued, self._tokens, now)
        )
        self._flag_over_claims()
        return updated

    def _flag_over_claims(self) -> None:
        for peer in self.store.peers().values():
            if peer.over_claimed(self.store.policy) and peer.peer_id not in self._flagged:
                self._flagged.add(peer.peer_id)
                log.warning(
                    "peer %s (%s) claims %.3g FLOPs of compute, but trainers receipted %.3g: it is credited "
                    "the receipted compute only",
                    peer.peer_id,
                    peer.identity,
                    peer.compute_flops,
                    peer.receipted_flops,
                )
