"""Presence and compute attacks on the monitor's points (bench/gaming.py): each cheat beside an honest twin doing
the same real work, over an hour of the monitor's scrapes every 10 s, credited by the monitor's own store
(agora_client/monitor/store.py: SQLite, receipts, the points rules) as a scrape does.

The records are the verified observations the scraper hands the store: the signatures, the auth service's slot
list and the stage roster are the parts that decide ``holds_slot`` and ``swarm_phase`` (tests/test_slot_presence.py,
tests/test_dht_validation.py test those parts against real processes).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agora_client.discovery.signed_records import Receipt, ServedCounts
from agora_client.monitor.points import PFLOP, Observation
from agora_client.monitor.store import PointsStore

HOUR_S = 3600.0
SCRAPE_EVERY_S = 10.0
FLOPS_PER_S = PFLOP / 600  # the twins' real work: 6 PFLOP an hour, as receipted by the trainer
STAGE = "body1"

Claim = Callable[[float], dict]  # scrape time -> what the cheat's record says (Observation fields)


@dataclass(frozen=True)
class Attack:
    name: str
    claim: Claim
    served: bool = True  # whether trainers routed to it (and so receipted its work)
    routed_phase: str = "active"  # the phase its stage's roster shows


def honest_claim(t: float) -> dict:
    return {"run_id": "run-1", "sync_phase": "active", "active_seconds": t, "compute_flops": FLOPS_PER_S * t}


def _replayed(t: float) -> dict:
    """Two genuine records of its first minute, sent in turn for the rest of the hour."""
    if t <= 60:
        return {**honest_claim(t), "published_at": t}
    first, second = honest_claim(50), honest_claim(60)
    return {**(first if int(t // SCRAPE_EVERY_S) % 2 else second), "published_at": 50 if int(t // 10) % 2 else 60}


ATTACKS = (
    Attack("rotating_run_ids", lambda t: {**honest_claim(t), "run_id": f"run-{t:.0f}"}),
    Attack("counter_reset", lambda t: {**honest_claim(t), "active_seconds": 0.0 if int(t // 10) % 2 else t}),
    # claims phase 2 with work it never did: trainers route by the roster, which keeps it in phase 1
    Attack("phase_claim", lambda t: {**honest_claim(t), "sync_phase": "sync2"}, served=False, routed_phase="sync1"),
    Attack("replayed_record", _replayed, served=True),
)


def _observation(peer: str, identity: str, t: float, claim: dict, routed_phase: str) -> Observation:
    fields = {"published_at": t, **claim}
    return Observation(
        peer_id=peer,
        identity=identity,
        stage=STAGE,
        seen_at=t,
        swarm_phase=routed_phase,
        **fields,
    )


def _receipt(t: float, served: dict[str, float]) -> Receipt:
    counts = {peer: ServedCounts(stage=STAGE, forwards=0, backwards=0, flops=flops) for peer, flops in served.items()}
    return Receipt(trainer="trainer", ticket="-", run_id="trainer-run", served=counts, ts=t)


def run_attack(attack: Attack, store_dir: Path) -> dict:
    """One hour of scrapes of the cheat and its honest twin; what each earned and what the twin's work was worth."""
    store = PointsStore(store_dir / f"{attack.name}.sqlite")
    try:
        t = 0.0
        while t <= HOUR_S:
            cheat_work = FLOPS_PER_S * t if attack.served else 0.0
            # an honest twin of the cheat's real standing: routed as the cheat is, and claiming only that
            twin_claim = honest_claim(t) if attack.served else {**honest_claim(t), "sync_phase": "sync1"}
            store.record_receipts([_receipt(t, {"honest": FLOPS_PER_S * t, "cheat": cheat_work})])
            observations = [
                _observation("honest", "alice", t, twin_claim, attack.routed_phase),
                _observation("cheat", "mallory", t, attack.claim(t), attack.routed_phase),
            ]
            store.record_scrape(observations, {}, t)
            t += SCRAPE_EVERY_S
        peers = store.peers()
    finally:
        store.close()
    honest, cheat = peers["honest"], peers["cheat"]
    worked_hours = HOUR_S / 3600
    honest_work_points = worked_hours + (FLOPS_PER_S * HOUR_S / PFLOP if attack.served else 0.0)
    return {
        "attack": attack.name,
        "cheat_score": cheat.score,
        "honest_score": honest.score,
        "cheat_ratio": cheat.score / honest.score,
        "honest_paid_ratio": honest.score / honest_work_points,
    }


def measure() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="agora-gaming-") as scratch:
        return [run_attack(attack, Path(scratch)) for attack in ATTACKS]
