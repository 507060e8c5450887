"""One scrape: read the stages' metrics records from the DHT, keep the verified ones, credit them as far as
ticketed trainers' receipts vouch for them (a claim far over its receipts is logged once); withhold the
compute points of workers that a ticketed trainer's verdict names; keep the points of the trainers' loss and
eval-loss curves from their progress records; and the swarm's summary for the public page (monitor/swarm_summary.py).
A record's phase is checked against its stage's roster and, when the monitor knows the auth service's URL, its peer
against the service's slot holders (monitor/auth_view.py: it also gives the queue lengths); a scrape that cannot read
the service counts every peer as holding its slot."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hivemind import DHT

from agora_client.discovery.progress_records import fetch_progress
from agora_client.discovery.roster import WorkerRecord, fetch_roster
from agora_client.events import SyncPhase
from agora_client.monitor.auth_view import fetch_auth_view
from agora_client.monitor.learning import learning_points
from agora_client.monitor.points import Observation, PeerState
from agora_client.monitor.receipts import fetch_receipts
from agora_client.monitor.records import VerifiedRecord, fetch_metrics
from agora_client.monitor.store import PointsStore
from agora_client.monitor.swarm_summary import TokenTally, summarize
from agora_client.monitor.verdicts import fetch_verdicts

log = logging.getLogger(__name__)


ROSTER_PHASES: dict[int, SyncPhase] = {0: "active", 1: "sync1", 2: "sync2"}


def observation_of(
    verified: VerifiedRecord,
    seen_at: float,
    roster: dict[str, WorkerRecord],
    holders: frozenset[str] | None = None,
) -> Observation:
    """What the swarm saw of the record's peer: its phase in its stage's ``roster`` by peer id (what trainers route on),
    and whether it is among the stage's slot ``holders`` at the auth service (None: the monitor does not know them)."""
    record = verified.record
    announced = roster.get(record.peer_id)
    return Observation(
        peer_id=record.peer_id,
        identity=verified.claims.identity,
        stage=record.stage,
        run_id=record.run_id,
        sync_phase=record.sync_phase,
        active_seconds=record.active_seconds,
        compute_flops=record.compute_flops,
        seen_at=seen_at,
        published_at=record.ts,
        swarm_phase=ROSTER_PHASES[announced.sync_phase] if announced is not None else None,
        holds_slot=holders is None or record.peer_id in holders,
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
        rosters = {stage: fetch_roster(self.dht, stage) for stage in self.stages}
        auth = fetch_auth_view(self.auth_url) if self.auth_url else None
        holders = auth.holders if auth is not None else None
        observations = [
            observation_of(
                item,
                now,
                rosters.get(item.record.stage, {}),
                None if holders is None else holders.get(item.record.stage, frozenset()),
            )
            for item in verified
        ]
        records = {item.record.peer_id: item.record.model_dump_json(exclude={"ticket"}) for item in verified}
        updated = self.store.record_scrape(observations, records, now)
        progress = fetch_progress(self.dht)
        self.store.record_learning(learning_points(progress))
        queued = auth.queued if auth is not None else None
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
