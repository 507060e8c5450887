"""The parts of bench/rehearsal.py that decide its figures without a swarm: the script drawn from a seed, the requests
a home served across its starts, the rank correlation of points with them, the paths read from headless lines, the
trainers' runs that the single process replays, what the auth service kept across its crash."""

from __future__ import annotations

import sys
from pathlib import Path

from agora_client.auth.admission import BookState, QueueEntry
from agora_client.auth.state_store import AuthStateStore
from agora_client.config import load_config
from agora_client.monitor.flops import request_flops

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # last: bench/ holds names like memory.py

from _rehearsal_convergence import TrainerLog  # noqa: E402
from _rehearsal_restarts import _committed, _queue_kept  # noqa: E402
from _rehearsal_scorecard import join_steps, path_of, served_flops, served_requests, spearman  # noqa: E402
from _rehearsal_script import LIAR_AT, draw  # noqa: E402


def _traffic(forwards: int, backwards: int) -> dict:
    return {"kind": "traffic", "forward_total": forwards, "backward_total": backwards}


def test_the_script_is_the_same_for_a_seed_and_moves_distinct_homes():
    at_once, actions = draw(7, 6, 2400)
    assert draw(7, 6, 2400) == (at_once, actions)
    assert draw(8, 6, 2400) != (at_once, actions)
    liar = [action for action in actions if action.home == 6]  # the homes after the honest ones: the liar joins
    assert [(action.what, action.at_s) for action in liar] == [("join", LIAR_AT * 2400)]  # and stays
    assert 7 in at_once and all(action.home != 7 for action in actions)  # the cheat starts at once and stays
    moved = {action.what: action.home for action in actions if action not in liar}
    assert len({moved["join"], moved["kill"], moved["interrupt"]}) == 3  # a late joiner, a killed one, a leaver
    assert moved["join"] not in at_once and at_once | {moved["join"]} == {*range(6), 7}
    assert moved["rejoin"] == moved["kill"] and [a.at_s for a in actions] == sorted(a.at_s for a in actions)
    assert all(0 < action.at_s < 2400 for action in actions)


def test_served_requests_add_up_each_start_of_a_home():
    first_start = [_traffic(0, 0), _traffic(5, 4), _traffic(9, 8)]
    second_start = [_traffic(1, 0), _traffic(6, 6)]
    assert served_requests(first_start + second_start + [{"kind": "step"}]) == 17 + 12
    assert served_requests([]) == 0


def test_rank_correlation_of_points_with_served_requests():
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]) == 1.0
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    assert spearman([1.0, 1.0, 2.0], [5.0, 5.0, 9.0]) == 1.0  # ties share their rank
    assert spearman([1.0, 2.0], [1.0, 2.0]) is None and spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None


def _a_join(started: float) -> list[dict]:
    """The events of one start of a home's runtime that reaches its first batch, a second apart from ``started``."""
    kinds = [
        {"kind": "preflight", "check": "gpu"},
        {"kind": "preflight", "check": "disk"},
        {"kind": "reachability", "status": "checking"},
        {"kind": "auth", "status": "authorizing"},
        {"kind": "auth", "status": "authorized"},
        {"kind": "download", "status": "started"},
        {"kind": "log", "tag": "DOWNLOAD", "message": "restored body1 at epoch 4"},
        {"kind": "download", "status": "done", "bytes": 1000},
        {"kind": "log", "tag": "JOIN", "message": "Worker up on body1"},
        {"kind": "sync", "phase": "sync1", "local_epoch": 6},
        {"kind": "sync", "phase": "sync2"},
        {"kind": "step", "forward_per_min": 3.0, "backward_per_min": 0.0},
    ]
    return [{**event, "ts": started + 1.0 + index} for index, event in enumerate(kinds)]


def test_a_joins_steps_are_read_from_the_start_that_served_the_first_batch_alone():
    events = _a_join(100.0) + _a_join(1000.0)  # killed after its first batch, then started again
    steps = join_steps(events, (100.0, 112.0), [100.0, 1000.0])
    assert steps["preflight_s"] == 1.0 and steps["open_port_s"] == 1.0  # not stretched to the rejoin's preflights
    assert steps["start_to_first_batch_s"] == 12.0 and steps["weights_lag_at_sync1_epochs"] == 2
    assert join_steps(events, None, [100.0, 1000.0]) is None


def test_the_path_is_the_latest_successful_dial_back():
    def line(status: str, path: str) -> dict:
        return {"tag": "REACHABILITY", "event": {"kind": "reachability", "status": status, "path": path}}

    lines = [{"tag": "AUTH", "event": {"kind": "auth"}}, line("reachable", "mapped"), line("unreachable", "")]
    assert path_of(lines) == "mapped"
    assert path_of([*lines, line("reachable", "relayed")]) == "relayed"
    assert path_of([{"tag": "INFO", "event": None}]) is None


def test_a_trainer_log_is_read_run_by_run_and_its_end_is_the_last_quarter_of_its_last_run(tmp_path):
    log = tmp_path / "trainers-trainer1.log"
    data = "[DATA] the standard library shard 1/2, tokenizer t.json (2,048 tokens), from the start"
    progress = "[PROGRESS] microbatches={} loss={} tokens_per_s=1.0 | head: 1/1 ready"
    lines = [data, "[EVAL] loss=7.5 sequences=8 tokens=1024", progress.format(0, "n/a"), progress.format(4, "7.0")]
    lines += [data, progress.format(2, "6.0"), progress.format(6, "5.0"), "[EVAL] loss=5.5 sequences=8 tokens=1024"]
    lines += [progress.format(7, "n/a"), progress.format(8, "4.0"), data, progress.format(0, "n/a")]
    log.write_text("\n".join(lines) + "\n")
    read = TrainerLog.read(log)
    assert str(read.shard) == "1/2" and read.last_eval == 5.5
    assert read.finished() == [4, 8, 0] and read.last_run() == 1  # started again at the stop, finished nothing
    assert read.end_window() == [(7, 8, 4.0)]  # from microbatch 6 of 8; the line with no loss is left out
    log.write_text("[TRAINER] the preset does not exist\n")
    assert TrainerLog.read(log) is None  # a trainer that never read its data


def test_queue_places_and_bindings_are_read_from_the_services_database_and_compared(tmp_path):
    store = AuthStateStore(tmp_path / "auth_state.sqlite3")
    waiting = [QueueEntry(f"q{n}", f"user{n}", f"Peer{n}", "tail", joined_at=1.0 + n, last_seen=9.0) for n in range(3)]
    store.save_book(BookState(queue=tuple(waiting)))
    store.bind("Peer0", "user0")
    before = _committed(store.path)
    assert before["bindings"] == {"Peer0": "user0"} and sorted(before["queue"]) == ["Peer0", "Peer1", "Peer2"]
    store.save_book(BookState(queue=tuple(waiting[1:])))  # Peer0 admitted: it left the queue for a slot
    after = _committed(store.path)
    assert _queue_kept(before, after, {"tail": ["Peer0"]}) is True
    assert _queue_kept(before, after, {"tail": []}) is False  # Peer0 neither queued nor holding a slot: lost
    newcomer = QueueEntry("q9", "user9", "Peer9", "tail", joined_at=5.0, last_seen=9.0)
    store.save_book(BookState(queue=(waiting[2], newcomer, waiting[1])))  # Peer1 third, behind a newcomer: sent back
    assert _queue_kept(before, _committed(store.path), {"tail": ["Peer0"]}) is False
    assert _committed(tmp_path / "absent.sqlite3") is None
    store.close()


def test_served_flops_price_each_starts_requests_at_the_stage_that_start_was_given():
    config = load_config("tiny")
    shape = (config.optim.microbatch_size, config.model.seq_len)

    def cost(stage: str, forwards: int, backwards: int) -> int:
        return forwards * request_flops(config.model, stage, "forward", *shape) + backwards * request_flops(
            config.model, stage, "backward", *shape
        )

    def authorized(stage: str) -> dict:
        return {"kind": "auth", "status": "authorized", "stage": stage}

    first_start = [authorized("head"), _traffic(0, 0), _traffic(5, 4), _traffic(9, 8)]
    second_start = [authorized("tail"), _traffic(1, 0), _traffic(6, 6)]  # a rejoin given another stage
    flops = served_flops(first_start + second_start, config)
    assert flops == cost("head", 9, 8) + cost("tail", 6, 6) and cost("tail", 1, 1) > cost("head", 1, 1)
    assert served_flops([_traffic(3, 3)], config) == 0.0  # no stage yet: nothing to price
