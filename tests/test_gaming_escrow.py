"""No stage pays for unchecked work (issue 46): compute served on a stage the spot checks cannot judge (two workers,
calibrating, unverifiable) waits in the trainer's escrow (agora_client/trainer/escrow.py) until checks vouch for it.

The trainer side is the real one (balancer, SpotChecker, ReceiptBook, Escrow) over in-process replicas
(tests/test_spotcheck.py's); the monitor side is the real PointsStore fed with the receipt, as the scraper feeds it."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from agora_client.config import SpotCheckConfig, load_config
from agora_client.discovery.signed_records import ServedCounts
from agora_client.monitor.operator_metrics import monitor_collector
from agora_client.monitor.page.views import swarm_view
from agora_client.monitor.points import PFLOP, Observation
from agora_client.monitor.store import PointsStore
from agora_client.trainer.escrow import Escrow
from agora_client.trainer.main import _overrides, configure
from agora_client.trainer.receipts import ReceiptBook
from agora_client.trainer.spotcheck import SpotChecker
from tests.test_spotcheck import STAGE, Replicas, swarm

MODEL = load_config("tiny").model
CONFIG = SpotCheckConfig(fraction=1.0, min_samples=10, window=50, escrow_window_s=10.0, escrow_hold_s=300.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Trainer:
    """A trainer's pipeline step for one stage: route, answer, receipt, spot-check; one request a second."""

    def __init__(self, router, client: Replicas, config: SpotCheckConfig = CONFIG):
        self.router, self.client, self.clock = router, client, Clock()
        self.book = ReceiptBook(MODEL, Escrow(config, self.clock))
        self.banned: list[str] = []
        self.checker = SpotChecker(
            config,
            router,
            {STAGE: client},
            receipts=self.book,
            on_ban=lambda finding: self.banned.append(finding.worker.peer_id),
            rng=random.Random(0),
        )
        self.dim = next(iter(client.weights.values())).shape[0]

    def serve(self, requests: int) -> None:
        for _ in range(requests):
            inputs = (torch.randn(4, self.dim), torch.zeros(4, 8, dtype=torch.long))
            lease = self.router[STAGE].choose("forward", 4.0)
            outputs = self.client.forward(lease.worker, inputs)
            self.router[STAGE].report_success(lease)
            self.book.count(STAGE, "forward", lease.worker.peer_id, inputs)
            self.checker.review(STAGE, "forward", 4.0, lease.worker, inputs, (), outputs)
            self.clock.now += 1.0

    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    def served(self) -> dict[str, ServedCounts]:
        return self.book.receipt("QmTrainer", "ticket", now=self.clock.now).served

    def standing(self) -> str:
        return self.checker.report()[STAGE].forward.state


def credited(served: dict[str, ServedCounts], tmp_path, withheld: tuple[str, ...] = ()) -> dict[str, float]:
    """Each worker's verified compute in the monitor's ledger, each having claimed exactly what it served."""
    store = PointsStore(tmp_path / "points.sqlite")
    for at, share in ((0.0, 0.0), (60.0, 1.0)):
        store.record_scrape([_claim(peer, at, counts.flops * share) for peer, counts in served.items()], {}, now=at)
    store.record_receipts([_receipt(served)])
    for peer in withheld:  # a ticketed trainer's verdict names it (monitor/scraper.py)
        store.withhold(peer, "banned by spot checks", now=60.0)
    points = {peer: state.compute_points for peer, state in store.peers().items()}
    store.close()
    return points


def _claim(peer: str, at: float, flops: float) -> Observation:
    return Observation(
        peer_id=peer,
        identity=f"owner of {peer}",
        stage=STAGE,
        run_id="r",
        sync_phase="active",
        active_seconds=at,
        compute_flops=flops,
        seen_at=at,
        published_at=at,
        swarm_phase="active",
    )


def _receipt(served: dict[str, ServedCounts]):
    from agora_client.discovery.signed_records import Receipt

    return Receipt(trainer="QmTrainer", ticket="checked by monitor/receipts.py", run_id="t1", served=served, ts=0.0)


def test_gaming_a_liar_in_a_two_worker_stage_is_paid_nothing(tmp_path) -> None:
    router, client, _ = swarm(2, liars={"body1.0.1"})
    trainer = Trainer(router, client)
    trainer.serve(200)
    assert trainer.standing() == "calibrating"  # two workers: no third answer, never judged
    trainer.wait(CONFIG.escrow_hold_s)  # nothing can vouch for either: escrow expires unpaid
    served = trainer.served()
    liar, honest = served["peer1"], served["peer0"]
    assert liar.flops > 0 and liar.forfeited_flops == pytest.approx(liar.flops) and liar.held_flops == 0
    assert honest.forfeited_flops == pytest.approx(honest.flops)  # the cost of a stage nobody can judge
    points = credited(served, tmp_path)
    assert points["peer1"] == 0.0 and points["peer0"] == 0.0


def test_gaming_a_reference_worker_decides_a_two_worker_stage(tmp_path) -> None:
    router, client, _ = swarm(3, liars={"body1.0.1"})  # two contributors and the operator's reference worker
    config = CONFIG.model_copy(update={"reference_workers": ["peer2"]})
    trainer = Trainer(router, client, config)
    trainer.serve(200)
    assert trainer.standing() == "verifiable" and trainer.banned == ["peer1"]
    served = trainer.served()
    assert served["peer1"].forfeited_flops > 0 and served["peer1"].held_flops == 0
    assert served["peer0"].payable_flops == pytest.approx(served["peer0"].flops)  # released once vouched
    assert served["peer2"].payable_flops == pytest.approx(served["peer2"].flops)  # the reference's is never held
    points = credited(served, tmp_path, withheld=("peer1",))
    assert points["peer1"] == 0.0 and points["peer0"] > 0


def test_gaming_a_liar_during_calibration_forfeits_what_it_served_then(tmp_path) -> None:
    router, client, _ = swarm(3, liars={"body1.0.2"})
    trainer = Trainer(router, client)
    while trainer.standing() == "calibrating":
        trainer.serve(1)
    while_calibrating = {peer: counts.flops for peer, counts in trainer.served().items()}
    client.liars.clear()  # it answers honestly once the stage is judged: no strike, no ban
    trainer.serve(100)
    served = trainer.served()
    assert trainer.banned == []  # at most the check that ended the calibration struck it: never banned
    assert served["peer2"].forfeited_flops == pytest.approx(while_calibrating["peer2"])
    assert served["peer2"].payable_flops == pytest.approx(served["peer2"].flops - while_calibrating["peer2"])
    for honest in ("peer0", "peer1"):  # honest compute is released once the calibration vouches for it
        assert served[honest].payable_flops == pytest.approx(served[honest].flops)
        assert served[honest].forfeited_flops == 0 and served[honest].held_flops == 0
    longest = trainer.book.escrow.longest_release_s
    assert longest is not None and CONFIG.escrow_window_s <= longest <= CONFIG.escrow_hold_s
    points = credited(served, tmp_path)
    assert points["peer0"] == pytest.approx(served["peer0"].flops / PFLOP)
    assert points["peer2"] == pytest.approx((served["peer2"].flops - while_calibrating["peer2"]) / PFLOP)


def test_gaming_a_liar_in_an_unverifiable_stage_is_paid_nothing(tmp_path) -> None:
    router, client, _ = swarm(4, drift=3.0, liars={"body1.0.3"}, dim=64)  # honest replicas ~1.37 apart
    trainer = Trainer(router, client)
    trainer.serve(100)
    assert trainer.standing() == "unverifiable" and trainer.banned == []
    assert trainer.served()["peer3"].held_flops > 0
    trainer.wait(CONFIG.escrow_hold_s)
    served = trainer.served()
    assert all(counts.payable_flops == 0 for counts in served.values())  # honest ones too: nothing could judge
    assert credited(served, tmp_path)["peer3"] == 0.0


def test_gaming_a_disputed_window_pays_neither_side_and_the_operator_sees_it(tmp_path) -> None:
    router, client, records = swarm(3, liars={"body1.0.1"})
    router.update_roster(records[:2])  # two answers per check: a disagreement nobody can settle yet
    trainer = Trainer(router, client)
    trainer.serve(int(CONFIG.escrow_window_s))  # one window's worth, one request a second
    disputed = {peer: counts.flops for peer, counts in trainer.served().items()}
    client.liars.clear()
    router.update_roster(records)  # a third worker joins: the stage calibrates and judges the windows
    trainer.serve(100)
    served = trainer.served()
    assert trainer.standing() == "verifiable"
    for peer in ("peer0", "peer1"):  # the honest worker and the liar alike
        assert served[peer].disputed_windows == 1
        assert served[peer].forfeited_flops == pytest.approx(disputed[peer])
        assert served[peer].payable_flops == pytest.approx(served[peer].flops - disputed[peer])

    store = PointsStore(tmp_path / "points.sqlite")
    store.record_receipts([_receipt(served)])
    assert store.escrow().disputed_windows == 2
    metrics = monitor_collector(store, clock=lambda: 0.0).collect()
    disputed_series = next(family for family in metrics if family.name == "agora_monitor_disputed_windows")
    assert disputed_series.samples[0].value == 2
    assert swarm_view(store, None, now=0.0)["escrow"]["disputed_windows"] == 2
    store.close()


def test_a_trainer_names_the_reference_workers_on_its_command_line() -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    seeds = ["--seeds", "/ip4/127.0.0.1/tcp/1"]
    assert load_config("tiny", _overrides(parser.parse_args(seeds))).spot_checks.reference_workers == []
    named = parser.parse_args([*seeds, "--reference-worker", "QmRefHead", "--reference-worker", "QmRefTail"])
    checks = load_config("tiny", _overrides(named)).spot_checks
    assert checks.reference_workers == ["QmRefHead", "QmRefTail"] and checks.fraction == SpotCheckConfig().fraction


def test_what_a_stopping_trainer_still_holds_is_forfeited() -> None:
    router, client, _ = swarm(2)
    trainer = Trainer(router, client)
    trainer.serve(20)
    assert all(counts.held_flops > 0 for counts in trainer.served().values())
    trainer.book.escrow.close()
    assert all(counts.forfeited_flops == counts.flops > 0 for counts in trainer.served().values())
