"""The parts of bench/rehearsal.py that decide its figures without a swarm: the script drawn from a seed, the requests
a home served across its starts, the rank correlation of points with them, the paths read from headless lines."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # last: bench/ holds names like memory.py

from _rehearsal_scorecard import path_of, served_requests, spearman  # noqa: E402
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


def test_the_path_is_the_latest_successful_dial_back():
    def line(status: str, path: str) -> dict:
        return {"tag": "REACHABILITY", "event": {"kind": "reachability", "status": status, "path": path}}

    lines = [{"tag": "AUTH", "event": {"kind": "auth"}}, line("reachable", "mapped"), line("unreachable", "")]
    assert path_of(lines) == "mapped"
    assert path_of([*lines, line("reachable", "relayed")]) == "relayed"
    assert path_of([{"tag": "INFO", "event": None}]) is None
