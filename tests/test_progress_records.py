"""The trainers' progress records: old records still parse, each evaluation joins the eval history once,
and the swarm's figures merge every trainer's curves (a real hivemind DHT on loopback)."""

from __future__ import annotations

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from agora_client.discovery.progress_records import PROGRESS_KEY, TrainerProgress, fetch_progress
from agora_client.trainer.progress import ProgressPublisher, swarm_event

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def dht():
    node = DHT(start=True, host_maddrs=LOOPBACK)
    try:
        yield node
    finally:
        node.shutdown()


def test_a_record_written_before_eval_losses_existed_still_parses():
    old = {"peer_id": "a", "microbatches": 10, "loss": 4.0, "tokens_per_s": 50.0, "history": [[1.0, 4.0]], "ts": 1.0}
    record = TrainerProgress.model_validate(old)
    assert record.eval_loss is None and record.eval_history == []
    assert swarm_event([record]).eval_loss is None


def test_one_evaluation_reported_at_several_reports_is_one_point(dht):
    publisher = ProgressPublisher(dht, ttl=60.0)
    assert publisher.publish(4, 5.0, 100.0)  # no evaluation yet
    assert publisher.publish(8, 4.8, 100.0, eval_loss=5.2, eval_at=1000.0)
    assert publisher.publish(12, 4.6, 100.0, eval_loss=5.2, eval_at=1000.0)  # the same evaluation again
    assert publisher.publish(16, 4.5, 100.0, eval_loss=4.9, eval_at=1060.0)
    [record] = [record for record in fetch_progress(dht) if record.peer_id == publisher.peer_id]
    assert record.eval_loss == 4.9
    assert record.eval_history == [(1000.0, 5.2), (1060.0, 4.9)]
    assert [loss for _, loss in record.history] == [5.0, 4.8, 4.6, 4.5]
    with pytest.raises(ValueError, match="eval_loss and eval_at together"):
        publisher.publish(20, 4.4, 100.0, eval_loss=4.8)


def test_an_old_trainer_record_in_the_dht_is_read(dht):
    """A trainer of the previous version stores no eval fields: contributors and the monitor still read it."""
    old = {"peer_id": "old-trainer", "microbatches": 3, "loss": 6.0, "history": [[5.0, 6.0]], "ts": 5.0}
    assert dht.store(PROGRESS_KEY, old, get_dht_time() + 60, subkey="old-trainer")
    [record] = [record for record in fetch_progress(dht) if record.peer_id == "old-trainer"]
    assert (record.loss, record.eval_loss, record.eval_history) == (6.0, None, [])


def test_the_swarm_eval_loss_is_the_mean_over_trainers_that_evaluated_and_the_histories_merge():
    records = [
        TrainerProgress(
            peer_id="a",
            microbatches=10,
            loss=4.0,
            history=[(1.0, 5.0)],
            eval_loss=4.4,
            eval_history=[(2.0, 4.9), (6.0, 4.4)],
            ts=6.0,
        ),
        TrainerProgress(peer_id="b", microbatches=12, loss=3.0, eval_loss=4.0, eval_history=[(4.0, 4.0)], ts=6.0),
        TrainerProgress(peer_id="c", microbatches=1, loss=3.5, ts=6.0),  # has not evaluated yet
    ]
    event = swarm_event(records)
    assert event.eval_loss == pytest.approx(4.2)
    assert event.eval_history == [(2.0, 4.9), (4.0, 4.0), (6.0, 4.4)]  # merged by time
    assert event.loss == pytest.approx(3.5) and event.loss_history == [(1.0, 5.0)]
