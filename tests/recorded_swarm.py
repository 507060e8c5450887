"""A monitor's store holding a recorded swarm, for the public page's tests and bench/page.py: contributors with peers on
tiny's stages, trainers' receipts, a withheld peer and an over-claiming one, a learning curve, a scrape's summary.
No swarm runs: this is what a monitor would have recorded from one, written through the store's own methods."""

from __future__ import annotations

from pathlib import Path

from agora_client.config import load_config
from agora_client.discovery.progress_records import CheckStanding, StageSpotChecks, TrainerProgress
from agora_client.discovery.signed_records import MetricsRecord, Receipt, ServedCounts
from agora_client.monitor.learning import LearningPoint
from agora_client.monitor.page import RunInfo, run_info
from agora_client.monitor.points import PFLOP, Observation, PointsPolicy
from agora_client.monitor.store import PointsStore
from agora_client.monitor.swarm_summary import TokenTally, summarize

HOSTILE_NAME = "<script>alert(1)</script>"
NAMED = ("alice", "bob", HOSTILE_NAME, "carol", "dave")
STAGES = load_config("tiny").model.stage_names
SCRAPE_INTERVAL_S = 600.0
SCRAPES = 6
FLOPS_PER_SCRAPE = 0.5 * PFLOP
TICKET = "TICKET-SECRET-never-on-the-page"
WITHHELD_REASON = "trainer QmTrainer: tail.0.3 disagreed with its stage 4 times in 20 spot checks"
POLICY = PointsPolicy(identity_cap=2, online_window_s=1.5 * SCRAPE_INTERVAL_S)  # every scrape sees them live


def usernames(contributors: int) -> list[str]:
    return [*NAMED[:contributors], *(f"user{index:04d}" for index in range(len(NAMED), contributors))]


def peers_of(names: list[str]) -> list[tuple[str, str, str]]:
    """(peer id, identity, stage): one peer each, alice two; the last contributor still syncing (see phase_of)."""
    peers = [
        (f"QmPeer{index:04d}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", name, STAGES[index % len(STAGES)])
        for index, name in enumerate(names)
    ]
    return (
        [*peers, ("QmPeerAlice2xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "alice", STAGES[-1])] if "alice" in names else peers
    )


def phase_of(peer_index: int, peers: int) -> str:
    return "sync1" if peer_index == peers - 1 and peers > 2 else "active"


def metrics(peer_id: str, identity: str, stage: str, phase: str, scrape: int, ts: float) -> MetricsRecord:
    flops = scrape * FLOPS_PER_SCRAPE
    return MetricsRecord(
        peer_id=peer_id,
        identity=identity,
        ticket=TICKET,
        stage=stage,
        run_id="r1",
        sync_phase=phase,
        flops_total=flops,
        compute_flops=flops if phase == "active" else 0.0,
        active_seconds=scrape * SCRAPE_INTERVAL_S,
        busy_seconds=scrape * 100.0,
        batches=scrape * 10,
        forwards=scrape * 20,
        tokens=scrape * 10_000,
        sparta_rounds=scrape,
        sparta_success_rate=0.75 if stage == "body1" else 1.0,
        ts=ts,
    )


def trainer_progress(now: float) -> TrainerProgress:
    standing = CheckStanding(state="verifiable", tolerance=0.01, samples=40)
    calibrating = CheckStanding(state="calibrating", samples=3)
    checks = {
        stage: StageSpotChecks(
            checks=20,
            strikes=4 if stage == "tail" else 0,
            bans=0,
            forward=standing,
            backward=standing if stage != "tail" else calibrating,
        )
        for stage in STAGES
    }
    return TrainerProgress(
        peer_id="QmTrainer", microbatches=500, loss=3.1, tokens_per_s=5123.0, spot_checks=checks, ts=now
    )


def learning_curve(start: float, now: float) -> list[LearningPoint]:
    span, steps = now - start, 60
    loss = [
        LearningPoint("QmTrainer", "loss", start + span * i / steps, 7.6 - 4.5 * (i / steps) ** 0.5)
        for i in range(steps + 1)
    ]
    evals = [
        LearningPoint("QmTrainer", "eval_loss", start + span * i / 6, 7.7 - 4.2 * (i / 6) ** 0.5) for i in range(7)
    ]
    return loss + evals


def record_swarm(path: Path, now: float, contributors: int = len(NAMED)) -> tuple[PointsStore, RunInfo]:
    """The store after ``SCRAPES`` scrapes ``SCRAPE_INTERVAL_S`` apart, the last at ``now``.

    Also the run it describes."""
    store = PointsStore(path, POLICY)
    peers = peers_of(usernames(contributors))
    start = now - (SCRAPES - 1) * SCRAPE_INTERVAL_S
    tally, records = TokenTally(), []
    for scrape in range(SCRAPES):
        ts = start + scrape * SCRAPE_INTERVAL_S
        records = [
            metrics(peer_id, identity, stage, phase_of(index, len(peers)), scrape, ts)
            for index, (peer_id, identity, stage) in enumerate(peers)
        ]
        # bob's peer over-claims: trainers receipted half of what it says it computed
        served = {
            record.peer_id: ServedCounts(
                stage=record.stage,
                forwards=record.forwards,
                backwards=record.batches,
                flops=record.compute_flops / (2 if record.identity == "bob" else 1),
            )
            for record in records
        }
        store.record_receipts([Receipt(trainer="QmTrainer", ticket=TICKET, run_id="t1", served=served, ts=ts)])
        observations = [
            Observation(
                r.peer_id,
                r.identity,
                r.stage,
                r.run_id,
                r.sync_phase,
                r.active_seconds,
                r.compute_flops,
                ts,
                r.ts,
                r.sync_phase,
            )
            for r in records
        ]
        store.record_scrape(observations, {r.peer_id: r.model_dump_json(exclude={"ticket"}) for r in records}, ts)
        if scrape == SCRAPES - 2 and "carol" in (identity for _, identity, _ in peers):
            store.withhold(next(p for p, identity, _ in peers if identity == "carol"), WITHHELD_REASON, ts)
    store.record_learning(learning_curve(start, now))
    queued = {stage: index for index, stage in enumerate(STAGES)}
    store.set_summary(summarize(STAGES, records, [trainer_progress(now)], queued, tally, now))
    return store, run_info(load_config("tiny"))
