"""The rehearsal's scorecard (bench/rehearsal.py): what each home, the trainers and the workers said, read from
their own outputs after the run; one dict (the JSON line) and a table.

- each home: its path (the reachability event of its headless lines), seconds from its first start to its first
  batch, split into the join's steps (bench/_join_phases.py), and the requests it served (its own traffic counters,
  ``forward_total + backward_total``, summed over its starts: each start counts from 0), and every mission figure
  present in its headless lines and event log;
- SPARTA: rounds ok / all, of every worker (the homes' event logs and the operator's workers' event files),
  overall and inside the script's churn windows;
- training: the trainers' microbatches (each start of a trainer counts from 0), tokens and tokens/s, their last loss
  and held-out loss (their logs, read by bench/_rehearsal_convergence.py, which sets them against one process);
- bans: every worker the trainers banned ([SPOTCHECK] banned ... (peer P)), honest or not;
- points: the monitor's leaderboard score of each home against the requests it served, their rank correlation among
  the honest homes, and the cheat's score per request served over the honest homes' median (at most 1.0: its
  rotating run ids earned it nothing).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import get_args

from _join_phases import join_phases
from _rehearsal_convergence import TrainerLog
from _rehearsal_homes import Home
from sparta_rounds import sparta_events, summarize

from agora_client.config import RunConfig
from agora_client.monitor.flops import RequestKind, request_flops
from agora_client.monitor.points import PFLOP

REQUEST_KINDS = get_args(RequestKind)  # ("forward", "backward"): the order of a traffic event's two counters
BANNED = re.compile(r"\[SPOTCHECK\] banned \S+ \(peer (\S+)\)")


def summed_over_restarts(counts: list[int]) -> int:
    """The total of a counter that starts again from 0 at each restart of its process: each run's last value, added."""
    total, last = 0, 0
    for count in counts:
        if count < last:  # a new run
            total += last
        last = count
    return total + last


def served_requests(events: list[dict]) -> int:
    """Requests a home served, by its own counters (``forward_total + backward_total``), over all its starts."""
    return summed_over_restarts([e["forward_total"] + e["backward_total"] for e in events if e["kind"] == "traffic"])


def served_flops(events: list[dict], config: RunConfig) -> float:
    """FLOPs of the requests a home served (what compute points pay for), by its own counters, each start's requests
    at the cost of the stage that start was given (``request_flops``, as the worker's metrics count them)."""
    shape = (config.optim.microbatch_size, config.model.seq_len)

    def cost(counts: tuple[int, ...], stage: str | None) -> float:
        if stage is None:
            return 0.0
        kinds = zip(counts, REQUEST_KINDS, strict=True)
        return sum(n * request_flops(config.model, stage, kind, *shape) for n, kind in kinds)

    total, stage, last, last_stage = 0.0, None, (0, 0), None
    for event in events:
        if event["kind"] == "auth" and event.get("status") == "authorized":
            stage = event["stage"]
        elif event["kind"] == "traffic":
            counts = (event["forward_total"], event["backward_total"])
            if sum(counts) < sum(last):  # a new start counts from 0
                total += cost(last, last_stage)
            last, last_stage = counts, stage
    return total + cost(last, last_stage)


def first_batch(home: Home, events: list[dict]) -> tuple[float, float] | None:
    """(the start that served the home's first batch, that batch's time): a home killed before its first batch is
    timed from its rejoin; None: it served none."""
    served = (
        e["ts"]
        for e in events
        if (e["kind"] == "traffic" and e["backward_total"] > 0)
        or (e["kind"] == "step" and (e["forward_per_min"] or e["backward_per_min"]))
    )
    first = min(served, default=None)
    starts = [start for start in home.started_at if first is not None and start <= first]
    return (starts[-1], first) if starts else None


def join_steps(events: list[dict], served: tuple[float, float] | None, starts: list[float]) -> dict | None:
    """Where the start that served the first batch spent its time (bench/_join_phases.py), from that start's events
    alone (a later start's would stretch its steps to the rejoin); None for a start whose events lack a step (a
    dishonest home's runtime prints no client events)."""
    if served is None:
        return None
    end = min((start for start in starts if start > served[0]), default=math.inf)
    try:
        return join_phases([e for e in events if served[0] <= e["ts"] < end], served[0])
    except (StopIteration, TypeError, KeyError):
        return None


def path_of(headless: list[dict]) -> str | None:
    """The path of the home's latest successful dial-back, as its headless lines carry it."""
    reached = [
        r["event"]["path"]
        for r in headless
        if (r.get("event") or {}).get("kind") == "reachability" and r["event"]["status"] == "reachable"
    ]
    return reached[-1] if reached else None


def mission_figures(headless: list[dict], events: list[dict]) -> dict:
    """What the client showed its owner: every kind present, the last figure of each (None: never present)."""
    printed = [r["event"] for r in headless if r.get("event")]
    by_kind: dict[str, list[dict]] = {}
    for event in [*printed, *events]:
        by_kind.setdefault(event["kind"], []).append(event)

    def last(kind: str) -> dict | None:
        return by_kind[kind][-1] if by_kind.get(kind) else None

    auth = next((e for e in by_kind.get("auth", []) if e["status"] == "authorized"), None)
    download, queue = last("download"), by_kind.get("queue", [])
    resources, points = last("resources"), last("points")
    sparta = by_kind.get("sparta", [])
    return {
        "authorization": auth and {"stage": auth["stage"], "slot": auth["slot"]},
        "download": download and {"status": download["status"], "bytes": download["bytes"]},
        "queue_position": max((e["position"] for e in queue), default=None),
        "sync_phases": list(dict.fromkeys(e["phase"] for e in by_kind.get("sync", []))),
        "memory": resources
        and {"process_rss_mb": round(resources["process_rss"] / 2**20), "gpu": resources["gpu"] or "cpu stand-in"},
        "sparta": f"{sum(e['ok'] for e in sparta)}/{len(sparta)}" if sparta else None,
        "points": points
        and {k: points.get(k) for k in ("presence", "compute", "confirmed", "verified_compute", "rank")},
        "kinds": sorted(by_kind),
    }


def home_card(home: Home, config: RunConfig) -> dict:
    events, headless = home.events(), home.headless()
    served = first_batch(home, events)
    return {
        "user": home.user,
        "router": home.kind,
        "link": home.link.label,
        "starts": len(home.runs),
        "path": path_of(headless),
        "first_batch_s": round(served[1] - served[0], 1) if served else None,
        "join_steps": join_steps(events, served, home.started_at),
        "served": served_requests(events),
        "served_flops": served_flops(events, config),
        "peer_id": next((e["peer_id"] for e in events if e["kind"] == "auth" and e.get("peer_id")), None),
        "mission": mission_figures(headless, events),
    }


def sparta_card(homes: list[Home], run_dir: Path, windows: list[tuple[float, float]]) -> dict:
    """Rounds of every worker, with their failures by reason. Every round counts: the operator runs two workers per
    stage, so a round no stage-mate joined in time failed its matchmaking, not for want of a peer."""
    rounds = [e for home in homes for e in home.events() if e["kind"] == "sparta"] + sparta_events(run_dir)
    inside = [e for e in rounds if any(start <= e["ts"] < end for start, end in windows)]
    outside = [e for e in rounds if not any(start <= e["ts"] < end for start, end in windows)]
    return {
        name: summarize(selected, -math.inf, math.inf)
        for name, selected in (("all", rounds), ("churn_windows", inside), ("outside_churn", outside))
    }


def training_card(log_dir: Path, tokens_per_microbatch: int, inflight: int, seconds: float) -> dict:
    """``seconds``: how long the trainers' hosts were meant to train (the script's length, restarts included)."""
    trainers = {}
    for path in sorted(log_dir.glob("trainers-trainer*.log")):
        if log := TrainerLog.read(path):
            losses = [loss for lines in log.runs for _, loss in lines if loss is not None]
            trainers[path.stem] = {
                "microbatches": sum(log.finished()),
                "starts": len(log.runs),
                "loss": losses[-1] if losses else None,
                "held_out_loss": log.last_eval,
            }
    microbatches = sum(t["microbatches"] for t in trainers.values())
    return {
        "tokens": microbatches * tokens_per_microbatch,
        "tokens_per_s": round(microbatches * tokens_per_microbatch / seconds, 1),
        "inflight_total": inflight * len(trainers),
        "trainers": trainers,
    }


def bans_card(log_dir: Path, cards: list[dict], liars: set[str]) -> dict:
    banned = {peer for path in log_dir.glob("trainers-trainer*.log") for peer in BANNED.findall(path.read_text())}
    liar_peers = {card["peer_id"] for card in cards if card["user"] in liars}
    return {
        "banned": sorted(banned),
        "honest_bans": len(banned - liar_peers),
        "liars_banned": f"{len(banned & liar_peers)}/{len(liar_peers)}",
    }


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation; None with fewer than 3 pairs or a constant side."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if vx == 0 or vy == 0 else round(cov / (vx * vy) ** 0.5, 3)


def points_card(cards: list[dict], leaderboard: list[dict], dishonest: set[str], cheat: str) -> dict:
    """Each home's score against the requests it served; their rank correlation among the honest homes; the cheat's
    score per request served over the honest homes' median (None where either is unknown). Apart, the compute points
    the monitor verified (as the home's client showed them; the client's own estimate counts its latest start only)
    against the FLOPs the home served: the score adds presence, which pays the hours a slot is held, and on tiny's
    cheap requests it is nearly all of the score."""
    scores = {row.get("username"): float(row.get("score", 0.0)) for row in leaderboard}
    rows = {
        card["user"]: {
            "score": scores.get(card["user"]),
            "served": card["served"],
            "compute": (card["mission"]["points"] or {}).get("verified_compute"),
            "served_pflop": card["served_flops"] / PFLOP,
        }
        for card in cards
    }
    honest = {user: r for user, r in rows.items() if user not in dishonest}
    scored = [(r["score"], r["served"]) for r in honest.values() if r["score"] is not None]
    per_request = sorted(score / served for score, served in scored if served)
    cheating = rows.get(cheat, {})
    ratio = None
    if per_request and cheating.get("score") is not None and cheating["served"]:
        ratio = round(cheating["score"] / cheating["served"] / statistics.median(per_request), 3)
    computed = [(r["compute"], r["served_pflop"]) for r in honest.values() if r["compute"] is not None]
    return {
        "per_home": rows,
        "honest_rank_correlation": spearman([s for s, _ in scored], [float(n) for _, n in scored]),
        "cheat_ratio": ratio,
        "honest_compute_rank_correlation": spearman([c for c, _ in computed], [f for _, f in computed]),
        "compute_share_of_score": round(sum(c for c, _ in computed) / sum(s for s, _ in scored), 4)
        if scored and sum(s for s, _ in scored)
        else None,
    }
