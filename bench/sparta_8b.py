#!/usr/bin/env python3
"""SPARTA rounds at the 8b preset's sizes on shaped home uplinks: success rate, round time and bytes per peer.

2 and 3 peers of one stage, each a process of its own (tests/sparta_peer.py) on a host of its own: a network
namespace on a bridge (tests/netns.py BridgedHosts; root and tc), with its own hivemind DHT, the first peer
the others' bootstrap. Every peer averages one flat float32 parameter the size of the 8b stage's SPARTA slice
(its trainable parameters / the preset's num_partitions: head, a body, tail; no model is built), with a
SpartaConfig of fraction 1.0, so every round moves the whole 8b slice. Every uplink is shaped with
``tc ... tbf`` to each rate in turn; payloads are fp32 and, when SpartaConfig has a ``payload`` switch, every
compressed payload it accepts. Per stage, group size, rate and payload: the share of the peers' rounds that
succeeded, the median round time, the bytes each peer sent and received (RoundReport) against the
butterfly's 2(n-1)/n x slice x bytes per value.

Time: the rounds take what the link takes, about 2(n-1)/n x slice bytes / rate. Each combination is planned
at 10 rounds where a round is estimated under 30 s and 3 otherwise, within --budget-min: the combinations
the issue's targets name first (fp32 at 100 Mbit/s, compressed payloads at 50), at 3 rounds, then their
10, then the others, cheapest first. What does not fit is listed as skipped, with its estimate.
Timeouts: chosen here for the rate, generous (see timeouts_for); they are printed with every combination.

    python bench/sparta_8b.py --quick     # as root; one body, 100 Mbit/s, 2 peers, fp32 + smallest payload, 5 rounds
    python bench/sparta_8b.py             # the whole grid, within 40 minutes

Peers of one stage and group size run together, one combination at a time; every namespace, qdisc and
process goes on exit, on failure, Ctrl-C and SIGTERM too. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the namespace helpers live in tests/

import psutil  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from agora_client.config import SpartaConfig, load_config  # noqa: E402
from agora_client.model.stages import param_counts  # noqa: E402
from tests.netns import BridgedHosts, unavailable  # noqa: E402
from tests.sparta_peer import (  # noqa: E402
    PeerFailed,
    close_averagers,
    open_averagers,
    run_round,
    start_peers,
    stop_peers,
)

PRESET = "8b"
STAGES = ("head", "body", "tail")
RATES_MBIT = (200.0, 100.0, 50.0)
GROUP_SIZES = (2, 3)
# per value and direction, on average: bf16 sends 2 bytes and gets float32 answers back (4), so 3; int8's codebooks
# add well under 1%
BYTES_PER_VALUE = {"fp32": 4, "bf16": 3, "int8": 1}
TARGET_MBIT = {"fp32": 100.0, "bf16": 50.0, "int8": 50.0}  # where the issue wants >= 95% of rounds to succeed
TARGET_SUCCESS = 0.95
FAST_ROUND_S, FAST_ROUNDS, MIN_ROUNDS, QUICK_ROUNDS = 30.0, 10, 3, 5
MATCHMAKING_S = SpartaConfig().matchmaking_time
CPU_BYTES_PER_S = 100e6  # a round's own copies and (de)serialization of the fp32 slice, on a small machine
STARTUP_S = 30.0  # peers of a group: imports, DHTs, the parameter
# a peer's peak RSS, its process and hivemind's averager process together (shared pages counted twice): the
# --quick run measured 2.45 GB per peer at the body's 181 MB slice
SLICE_COPIES, PEER_BASE_MB = 10, 600
SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True)
class Combination:
    peers: int
    stage: str
    values: int  # float32 values in the slice
    mbit: float
    payload: str

    @property
    def butterfly_bytes(self) -> float:
        return 2 * (self.peers - 1) / self.peers * self.values * BYTES_PER_VALUE[self.payload]

    @property
    def link_s(self) -> float:
        """Seconds the butterfly's bytes take over one shaped uplink (every peer sends as much)."""
        return self.butterfly_bytes * 8 / (self.mbit * 1e6)

    @property
    def estimate_s(self) -> float:
        return self.link_s + MATCHMAKING_S + self.values * 4 / CPU_BYTES_PER_S

    @property
    def wanted_rounds(self) -> int:
        return FAST_ROUNDS if self.estimate_s < FAST_ROUND_S else MIN_ROUNDS

    @property
    def at_target(self) -> bool:
        return self.mbit == TARGET_MBIT[self.payload]

    @property
    def label(self) -> str:
        return f"{self.stage} x{self.peers} {self.mbit:g} Mbit {self.payload}"


def timeouts_for(link_s: float) -> dict[str, float]:
    """Generous SPARTA timeouts for a round whose bytes take link_s over the uplink.

    Link-derived ones replace these."""
    return {
        "allreduce_timeout": round(2 * link_s + 30),
        "sender_timeout": round(10 + link_s / 2),
        "reducer_timeout": round(10 + link_s / 2),
    }


def sparta_fields(combination: Combination, payload_switch: bool) -> dict:
    fields = {"fraction": 1.0, **timeouts_for(combination.link_s)}
    return {**fields, "payload": combination.payload} if payload_switch else fields


def available_payloads() -> list[str]:
    """fp32, and the compressed payloads SpartaConfig accepts if it has a payload switch."""
    if "payload" not in SpartaConfig.model_fields:
        return ["fp32"]
    accepted = []
    for payload in BYTES_PER_VALUE:
        try:
            SpartaConfig(payload=payload)
        except ValidationError:
            continue
        accepted.append(payload)
    return accepted


def stage_values() -> dict[str, int]:
    """Values in one SPARTA slice of the 8b head, first body and tail (trainable parameters / num_partitions)."""
    config = load_config(PRESET)
    counts = param_counts(config.model)
    body = next(name for name in counts if name.startswith("body"))
    named = {"head": counts["head"], "body": counts[body], "tail": counts["tail"]}
    return {stage: math.ceil(count / config.sparta.num_partitions) for stage, count in named.items()}


def group_memory_mb(peers: int, values: int) -> float:
    return peers * (SLICE_COPIES * values * 4 / 1e6 + PEER_BASE_MB)


def available_memory_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _take(rounds: dict, started: set, combination: Combination, count: int, budget: list[float]) -> None:
    """Plan ``count`` rounds of ``combination`` if they fit the budget left (budget[0], seconds)."""
    group = (combination.peers, combination.stage)
    added = count - rounds.get(combination, 0)
    cost = added * combination.estimate_s + (0 if group in started else STARTUP_S)
    if added > 0 and cost <= budget[0]:
        rounds[combination] = count
        started.add(group)
        budget[0] -= cost


def plan(combinations: list[Combination], budget_s: float) -> dict[Combination, int]:
    """Rounds per combination: targets at 3 rounds, then at their 10, then the others alike, cheapest first."""
    rounds: dict[Combination, int] = {}
    started: set[tuple[int, str]] = set()
    budget = [budget_s]
    for wanted_target in (True, False):
        chosen = sorted((c for c in combinations if c.at_target == wanted_target), key=lambda c: c.estimate_s)
        for combination in chosen:
            _take(rounds, started, combination, MIN_ROUNDS, budget)
        for combination in chosen:
            if combination in rounds:
                _take(rounds, started, combination, combination.wanted_rounds, budget)
    return rounds


def summarize(combination: Combination, reports: list[dict], peak_rss: list[dict]) -> dict:
    ok = [report for report in reports if report["ok"]]
    sent = statistics.mean(r["bytes_sent"] for r in ok) if ok else None
    # the reason without its numbers, so that alike failures add up
    failures = Counter(re.sub(r"\d+(\.\d+)?", "N", r["reason"] or "") for r in reports if not r["ok"])
    return {
        "stage": combination.stage,
        "peers": combination.peers,
        "mbit": combination.mbit,
        "payload": combination.payload,
        "values": combination.values,
        "rounds": len(reports) // combination.peers,
        "timeouts": timeouts_for(combination.link_s),
        "success_rate": round(len(ok) / len(reports), 3),
        "full_groups": sum(1 for r in ok if r["group_size"] == combination.peers and r["fraction"] == 1.0),
        "median_round_s": round(statistics.median(r["duration_s"] for r in ok), 2) if ok else None,
        "median_allreduce_s": (
            round(statistics.median(r["allreduce_s"] for r in ok), 2) if ok and "allreduce_s" in ok[0] else None
        ),
        "expected_link_s": round(combination.link_s, 1),
        "bytes_sent_per_peer": round(sent) if ok else None,
        "bytes_received_per_peer": round(statistics.mean(r["bytes_received"] for r in ok)) if ok else None,
        "butterfly_bytes": round(combination.butterfly_bytes),
        "sent_over_butterfly": round(sent / combination.butterfly_bytes, 3) if ok else None,
        "failures": dict(failures.most_common()),
        "peak_rss_mb_per_peer": max(rss["peer"] + rss["averager"] for rss in peak_rss),
    }


def measure(
    peers: list, hosts: BridgedHosts, combination: Combination, rounds: int, payload_switch: bool, first_round: int
) -> dict:
    """``rounds`` rounds of one combination on the group's running peers."""
    for host in hosts.hosts:
        host.shape_uplink(combination.mbit)
    fields = sparta_fields(combination, payload_switch)
    # hivemind keys: one prefix per combination, so no round meets a group of another
    prefix = f"sparta8b_{combination.payload}_{round(combination.mbit)}"
    # a round ends within its own bounds (SpartaAverager); waiting longer only catches a hung peer
    wait_s = fields["allreduce_timeout"] + 6 * MATCHMAKING_S + 60 + combination.values * 4 / CPU_BYTES_PER_S
    open_averagers(peers, prefix, combination.values, fields, timeout=120.0)
    reports = []
    for round_no in range(first_round, first_round + rounds):
        reports += run_round(peers, round_no, wait_s)
    return summarize(combination, reports, close_averagers(peers, timeout=120.0))


def print_row(combination: Combination, row: dict) -> None:
    median = "-" if row["median_round_s"] is None else f"{row['median_round_s']:.1f}s"
    sent = "-" if row["sent_over_butterfly"] is None else f"{row['sent_over_butterfly']:.3f}"
    print(
        f"  {combination.label:28s} {row['success_rate']:6.0%} of {row['rounds']:2d} rounds x {combination.peers}"
        f"  median {median:>7} (link alone {row['expected_link_s']:.1f}s)  sent/butterfly {sent}"
        f"  timeouts {row['timeouts']}  peak RSS/peer {row['peak_rss_mb_per_peer']:.0f} MB"
        f"  failures {row['failures'] or '-'}",
        flush=True,
    )
    if row["sent_over_butterfly"] is not None and row["sent_over_butterfly"] > 1.5:
        print(
            f"    {combination.payload}: {row['sent_over_butterfly']:.1f}x the butterfly's bytes for this payload were "
            "sent: it is not compressed on the wire",
            flush=True,
        )


def run_group(
    group: list[Combination],
    rounds: dict[Combination, int],
    args: argparse.Namespace,
    deadline: float,
    skipped: list[dict],
) -> list[dict]:
    """Every planned combination of one stage and group size, on one set of peers; rows measured."""
    first = group[0]
    need, have = group_memory_mb(first.peers, first.values), available_memory_mb()
    if need > have:
        skipped += [skip(c, f"needs ~{need:,.0f} MB of memory, {have:,.0f} MB available") for c in group]
        return []
    rows, round_no = [], 0
    log_dir = args.run_dir / f"{first.stage}-x{first.peers}"
    log_dir.mkdir(parents=True, exist_ok=True)
    shared_before = set(SHARED_MEMORY.glob("torch_*"))
    with BridgedHosts(f"agi26b-{os.getpid()}", first.peers) as hosts:
        peers = start_peers(hosts.hosts, log_dir)
        try:
            ordered = sorted(group, key=lambda c: not c.at_target)  # the targets first: the deadline cuts the end
            for index, combination in enumerate(ordered):
                count = min(rounds[combination], int((deadline - time.monotonic()) // combination.estimate_s))
                if count < min(MIN_ROUNDS, rounds[combination]):
                    skipped.append(skip(combination, "the time budget ran out"))
                    continue
                try:
                    row = measure(peers, hosts, combination, count, args.payload_switch, round_no)
                except PeerFailed as error:  # e.g. killed for memory: this group's peers cannot go on
                    print(
                        f"  {combination.label}: {error} (the kernel's log says whether it ran out of memory)",
                        flush=True,
                    )
                    skipped += [skip(c, f"a peer of the group failed: {error}") for c in ordered[index:]]
                    break
                round_no += count
                print_row(combination, row)
                rows.append(row)
        finally:
            stop_peers(peers)
            remove_leaked_shared_memory(shared_before)
    return rows


def remove_leaked_shared_memory(before: set[Path]) -> None:
    """Delete the shared-memory files this group's peers made and left: hivemind shares tensors through files
    (torch's file_system strategy), which stay when a process is stopped hard, and the next group needs that memory."""
    made = {
        path: path.name.split("_")[1] for path in set(SHARED_MEMORY.glob("torch_*")) - before
    }  # torch_<pid>_<random>_<n>
    leaked = [path for path, pid in made.items() if pid.isdigit() and not psutil.pid_exists(int(pid))]
    size = sum(path.stat().st_size for path in leaked if path.exists())
    for path in leaked:
        path.unlink(missing_ok=True)
    if leaked:
        print(f"  removed {len(leaked)} shared-memory files the peers left ({size / 1e6:,.0f} MB)", flush=True)


def skip(combination: Combination, why: str) -> dict:
    return {"label": combination.label, "estimated_round_s": round(combination.estimate_s, 1), "why": why}


def grid(args: argparse.Namespace, payloads: list[str], values: dict[str, int]) -> list[Combination]:
    """The combinations to measure; quick: one body, 100 Mbit/s, 2 peers, fp32 and the smallest payload."""
    if args.quick:
        chosen = payloads[:1] + sorted(payloads[1:], key=BYTES_PER_VALUE.get)[:1]
        return [Combination(2, "body", values["body"], 100.0, payload) for payload in chosen]
    return [
        Combination(peers, stage, values[stage], mbit, payload)
        for peers in args.group_sizes
        for stage in args.stages
        for payload in payloads
        for mbit in RATES_MBIT
    ]


def print_plan(
    combinations: list[Combination], rounds: dict[Combination, int], values: dict[str, int], budget_s: float
) -> None:
    print(f"8b SPARTA slices (float32 values): {values}; payloads: {sorted({c.payload for c in combinations})}")
    planned = sum(n * c.estimate_s for c, n in rounds.items())
    print(
        f"plan: {len(rounds)} of {len(combinations)} combinations, ~{planned / 60:.0f} min of rounds "
        f"(budget {budget_s / 60:.0f} min)",
        flush=True,
    )
    for combination in combinations:
        count = rounds.get(combination)
        print(
            f"  {combination.label:28s} est. {combination.estimate_s:6.1f}s/round  "
            f"{'skipped' if count is None else f'{count} rounds'}  timeouts {timeouts_for(combination.link_s)}"
        )
    for peers, stage in sorted({(c.peers, c.stage) for c in rounds}):
        print(
            f"  memory, {stage} x{peers}: ~{group_memory_mb(peers, values[stage]):,.0f} MB "
            f"({available_memory_mb():,.0f} MB available)"
        )


def target_checks(rows: list[dict], payloads: list[str]) -> dict[str, bool | None]:
    """Per payload: whether every measured combination at its target rate had >= 95% of rounds succeed."""
    checks = {}
    for payload in payloads:
        at = [row for row in rows if row["payload"] == payload and row["mbit"] == TARGET_MBIT[payload]]
        checks[f"{payload}_at_{TARGET_MBIT[payload]:g}_mbit"] = (
            all(row["success_rate"] >= TARGET_SUCCESS for row in at) if at else None
        )
    return checks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one body at 100 Mbit/s, 2 peers, fp32 and the smallest compressed payload, 5 rounds each",
    )
    parser.add_argument("--budget-min", type=float, default=40.0, help="minutes the whole bench may take")
    parser.add_argument("--run-dir", type=Path, default=None, help="peer logs go here (default: a temporary folder)")
    parser.add_argument(
        "--stages",
        type=_choices(STAGES, str),
        default=STAGES,
        help=f"the stages to measure, comma-separated (default {','.join(STAGES)})",
    )
    parser.add_argument(
        "--group-sizes",
        type=_choices(GROUP_SIZES, int),
        default=GROUP_SIZES,
        help=f"the group sizes to measure, comma-separated (default {','.join(map(str, GROUP_SIZES))})",
    )
    args = parser.parse_args()
    if args.budget_min <= 0:
        parser.error("--budget-min must be positive")
    return args


def _choices(allowed: tuple, kind: type):
    """An argparse type: a comma-separated subset of ``allowed``."""

    def parse(text: str) -> tuple:
        try:
            chosen = tuple(kind(item) for item in text.split(",") if item)
        except ValueError:
            chosen = ()
        if not chosen or not set(chosen) <= set(allowed):
            raise argparse.ArgumentTypeError(f"{text!r}: give some of {','.join(map(str, allowed))}")
        return chosen

    return parse


def main() -> int:
    args = parse_args()
    if reason := unavailable(shaping=True):
        raise SystemExit(f"peers on hosts of their own need network namespaces: {reason}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl-C
    started, budget_s = time.monotonic(), args.budget_min * 60
    args.run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-sparta-8b-"))
    payloads = available_payloads()
    args.payload_switch = "payload" in SpartaConfig.model_fields
    if not args.payload_switch:
        print("SpartaConfig has no payload switch: fp32 only", flush=True)
    values = stage_values()
    combinations = grid(args, payloads, values)
    if args.quick:
        rounds = {combination: QUICK_ROUNDS for combination in combinations}
    else:
        rounds = plan(combinations, budget_s - (time.monotonic() - started))
    print_plan(combinations, rounds, values, budget_s)
    skipped = [skip(c, "did not fit the time budget") for c in combinations if c not in rounds]
    rows = []
    for group_key in sorted({(c.peers, c.stage) for c in rounds}):
        group = [c for c in combinations if c in rounds and (c.peers, c.stage) == group_key]
        rows += run_group(group, rounds, args, started + budget_s, skipped)
    print_summary(args, rows, skipped, payloads, time.monotonic() - started)
    return 0


def print_summary(
    args: argparse.Namespace, rows: list[dict], skipped: list[dict], payloads: list[str], elapsed_s: float
) -> None:
    for entry in skipped:
        print(f"  skipped {entry['label']} (est. {entry['estimated_round_s']}s/round): {entry['why']}")
    result = {
        "bench": "sparta_8b",
        "mode": "quick" if args.quick else "full",
        "preset": PRESET,
        "cpus": os.cpu_count(),
        "payloads": payloads,
        "elapsed_s": round(elapsed_s, 1),
        "budget_s": args.budget_min * 60,
        "timeouts": "chosen by the bench per rate: allreduce 2T+30 s, sender and reducer 10+T/2 s, T = the "
        "butterfly's bytes over the shaped uplink",
        "rows": rows,
        "skipped": skipped,
        "targets": target_checks(rows, payloads),
    }
    if args.quick:
        fp32 = [row for row in rows if row["payload"] == "fp32"]
        compressed = [row for row in rows if row["payload"] != "fp32"]
        result["fp32_success"] = fp32[0]["success_rate"] if fp32 else None
        result["compressed_success"] = compressed[0]["success_rate"] if compressed else None
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
