"""SPARTA traffic: bytes per round per peer and round duration, sparse slice vs full-parameter average.

Starts N local peers (own process, own DHT, loopback) holding the real `tiny` body1 stage with different
weights. Each peer runs two SpartaAveragers side by side: the preset's fraction and fraction 1.0 (the
full-parameter average, same butterfly all-reduce). Bytes are the averager's own count of serialized
averaging messages; durations include matchmaking (the preset's matchmaking_time), identical for both.
Also prints the formula figure (fraction x params x 4 bytes) for every stage of the 8b preset.

    python bench/sparta_traffic.py [--peers 3] [--rounds 3]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
from contextlib import suppress
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agora_client.config import load_config  # noqa: E402
from agora_client.model import build_stage, param_counts  # noqa: E402

STAGE = "body1"
MODES = ("sparse", "full")


def _peer(conn: Connection, index: int, initial_peers: list[str], rounds: int) -> None:
    os.setpgrp()  # the bench reaps this peer with its DHT, averagers and p2pd in one kill
    from hivemind import DHT

    from agora_client.averaging.sparta import SpartaAverager

    torch.set_num_threads(1)
    config = load_config("tiny")
    stage = build_stage(config.model, STAGE, seed=index)  # different weights on every peer
    parameters = [p for p in stage.parameters() if p.requires_grad]
    lock = threading.Lock()
    dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    conn.send([str(addr) for addr in dht.get_visible_maddrs()])
    averagers = {
        "sparse": SpartaAverager(dht, "bench_sparse", parameters, config.sparta, lock=lock),
        "full": SpartaAverager(
            dht, "bench_full", parameters, config.sparta.model_copy(update={"fraction": 1.0}), lock=lock
        ),
    }
    conn.send(sum(p.numel() for p in parameters))
    try:
        for round_no in range(rounds):
            for mode in MODES:
                conn.recv()  # start together with the other peers
                report = averagers[mode].begin_round(round_no, 1.0).result()
                conn.send((mode, report))
    finally:
        for averager in averagers.values():
            averager.shutdown()
        dht.shutdown()
        conn.send("done")


def _recv(conn: Connection, process: mp.Process, timeout: float = 300.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"peer pid {process.pid} did not answer within {timeout:.0f}s")
    return conn.recv()


def measure(peers: int, rounds: int) -> dict:
    context = mp.get_context("fork")
    processes: list[mp.Process] = []
    conns: list[Connection] = []
    initial_peers: list[str] = []
    try:
        for index in range(peers):
            parent, child = context.Pipe()
            process = context.Process(target=_peer, args=(child, index, initial_peers, rounds))
            process.start()
            processes.append(process)
            conns.append(parent)
            if index == 0:
                initial_peers = _recv(parent, process)
        for conn, process in list(zip(conns, processes, strict=True))[1:]:
            _recv(conn, process)
        params = {_recv(conn, process) for conn, process in zip(conns, processes, strict=True)}.pop()
        reports = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for _mode in MODES:  # each peer runs the modes in this order and says which one it ran
                for conn in conns:
                    conn.send("go")
                for conn, process in zip(conns, processes, strict=True):
                    got_mode, report = _recv(conn, process)
                    reports[got_mode].append(report)
        for conn, process in zip(conns, processes, strict=True):
            _recv(conn, process)
    finally:
        for process in processes:
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.join(10)
    return dict(params=params, reports=reports)


def summarize(params: int, reports: dict, fraction: float, peers: int) -> dict:
    rows = {}
    for mode in MODES:
        good = [r for r in reports[mode] if r.ok]
        share = fraction if mode == "sparse" else 1.0
        slice_bytes = share * params * 4
        rows[mode] = dict(
            rounds_ok=len(good),
            rounds=len(reports[mode]),
            group_size=max((r.group_size for r in good), default=0),
            bytes_sent_per_peer=statistics.mean(r.bytes_sent for r in good) if good else None,
            bytes_received_per_peer=statistics.mean(r.bytes_received for r in good) if good else None,
            duration_s=statistics.median(r.duration_s for r in good) if good else None,
            formula_bytes=slice_bytes,
            butterfly_bytes=2 * (peers - 1) / peers * slice_bytes,
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3, help="local peers of the stage (2-4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode")
    args = parser.parse_args()
    if not 2 <= args.peers <= 4 or args.rounds < 1:
        parser.error("use 2-4 peers and at least 1 round")

    tiny = load_config("tiny")
    fraction = tiny.sparta.fraction
    measured = measure(args.peers, args.rounds)
    rows = summarize(measured["params"], measured["reports"], fraction, args.peers)

    print(
        f"tiny {STAGE}: {measured['params']:,} trainable parameters, {args.peers} peers, {args.rounds} rounds per mode"
    )
    print(
        f"{'mode':<7} {'ok':>5} {'sent/peer':>12} {'recv/peer':>12} {'butterfly':>12} {'formula':>12} {'duration':>9}"
    )
    for mode, row in rows.items():
        sent = f"{row['bytes_sent_per_peer']:,.0f}" if row["bytes_sent_per_peer"] is not None else "-"
        received = f"{row['bytes_received_per_peer']:,.0f}" if row["bytes_received_per_peer"] is not None else "-"
        duration = f"{row['duration_s']:.2f}s" if row["duration_s"] is not None else "-"
        print(
            f"{mode:<7} {row['rounds_ok']:>2}/{row['rounds']:<2} {sent:>12} {received:>12} "
            f"{row['butterfly_bytes']:>12,.0f} {row['formula_bytes']:>12,.0f} {duration:>9}"
        )
    print("butterfly = 2(n-1)/n x slice x 4 B: each peer uploads the (n-1)/n of its slice that others reduce,")
    print("plus the averaged 1/n it reduced back to each of the n-1 others; formula = fraction x params x 4 B")
    sparse, full = rows["sparse"], rows["full"]
    ratio = (
        sparse["bytes_sent_per_peer"] / full["bytes_sent_per_peer"]
        if sparse["bytes_sent_per_peer"] and full["bytes_sent_per_peer"]
        else None
    )
    if ratio is not None:
        print(f"sparse / full bytes per round: {ratio:.4f} (fraction {fraction})")

    eight_b = load_config("8b")
    counts = param_counts(eight_b.model)
    formula_8b = {name: eight_b.sparta.fraction * count * 4 for name, count in counts.items()}
    print(f"8b preset, fraction {eight_b.sparta.fraction}: bytes per round per peer by the reference's formula (fp32)")
    for name, count in counts.items():
        print(f"  {name:<6} {count:>14,} params  {formula_8b[name] / 1e6:>8.1f} MB")

    print(
        json.dumps(
            dict(
                stage=STAGE,
                params=measured["params"],
                peers=args.peers,
                rounds=args.rounds,
                fraction=fraction,
                sparse=sparse,
                full=full,
                sparse_over_full_bytes=ratio,
                formula_8b_bytes=formula_8b,
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
