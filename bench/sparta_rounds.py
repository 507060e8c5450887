#!/usr/bin/env python3
"""How many SPARTA rounds succeed in a training swarm: undisturbed, then while workers are killed and replaced.

One local swarm (tiny preset, real processes on 127.0.0.1): --workers per stage and one trainer. Every worker
writes its SpartaEvents (one per round it began) to its event file. Phase "quiet": the swarm trains for
--quiet seconds. Phase "churn": for --churn seconds, every --kill-every seconds one worker (stages in turn)
is SIGKILLed, like a crash, and a fresh worker of the same stage is started in its place. A round counts as
ok when it averaged its slice with at least one other worker; every other SpartaEvent (no group, skipped,
gave way, all weights zero) is a failure, with its reason tallied. Figures per phase, with the machine's load.

    python bench/sparta_rounds.py                    # 2 workers per stage, ~8 min on 2 cores
    python bench/sparta_rounds.py --workers 3 --quiet 120 --churn 120

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agora_client.events import json_objects  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402


def sparta_events(run_dir: Path) -> list[dict]:
    events = []
    for path in sorted((run_dir / "events").glob("*.jsonl")):
        worker = path.stem
        for event in json_objects(path.read_text(encoding="utf-8").splitlines()):
            if event.get("kind") == "sparta":
                events.append({**event, "worker": worker})
    return events


def summarize(events: list[dict], since: float, until: float) -> dict:
    window = [event for event in events if since <= event["ts"] < until]
    ok = [event for event in window if event["ok"]]
    # the reason without its numbers, so that alike failures add up
    reasons = Counter(re.sub(r"\d+(\.\d+)?", "N", event.get("reason") or "") for event in window if not event["ok"])
    return {
        "rounds": len(window),
        "ok": len(ok),
        "success_rate": round(len(ok) / len(window), 3) if window else None,
        "full_groups": sum(1 for event in ok if event["fraction"] == 1.0),
        "median_duration_s": round(sorted(e["duration_s"] for e in ok)[len(ok) // 2], 2) if ok else None,
        "failures": dict(reasons.most_common()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="workers per stage (2 or 3)")
    parser.add_argument("--quiet", type=float, default=180.0, help="seconds measured without disturbance")
    parser.add_argument("--churn", type=float, default=180.0, help="seconds measured while workers are replaced")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between two kills")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of training before measuring")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args()
    if args.workers not in (2, 3) or min(args.quiet, args.churn, args.kill_every, args.warmup) <= 0:
        parser.error("use 2 or 3 workers per stage and positive durations")

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-sparta-rounds-"))
    swarm = LocalSwarm(SwarmOptions(workers_per_stage=args.workers, trainers=1, run_dir=run_dir, report_every=5.0))
    stages = list(swarm.config.model.stage_names)
    kills = []
    try:
        swarm.start()
        print(
            f"swarm up in {time.monotonic() - swarm.started_at:.0f}s: {args.workers} workers per stage; "
            f"logs in {run_dir / 'logs'}",
            flush=True,
        )
        time.sleep(args.warmup)
        quiet_from = time.time()
        time.sleep(args.quiet)
        quiet_load = os.getloadavg()[0]
        churn_from = time.time()
        print(
            f"quiet phase done (load {quiet_load:.2f}); churn phase: a worker replaced every {args.kill_every:.0f}s",
            flush=True,
        )
        while time.time() < churn_from + args.churn:
            time.sleep(min(args.kill_every, max(0.0, churn_from + args.churn - time.time())))
            if time.time() >= churn_from + args.churn:
                break
            stage = stages[len(kills) % len(stages)]
            victim = next(worker for worker in swarm.workers[stage] if worker.alive)
            victim.kill_main()  # a crash: no goodbye to its group
            victim.stop(grace=0.0)  # reaps what the crash left behind (p2pd)
            replacement = swarm.start_worker(stage)
            kills.append((victim.name, replacement.name))
            print(f"  killed {victim.name}, started {replacement.name}", flush=True)
        churn_until = time.time()
        churn_load = os.getloadavg()[0]
    finally:
        swarm.stop()

    events = sparta_events(run_dir)
    quiet = summarize(events, quiet_from, churn_from)
    churn = summarize(events, churn_from, churn_until)
    for name, phase, load in (("quiet", quiet, quiet_load), ("churn", churn, churn_load)):
        rate = f"{phase['success_rate']:.1%}" if phase["success_rate"] is not None else "-"
        print(
            f"{name}: {phase['ok']}/{phase['rounds']} rounds ok ({rate}), {phase['full_groups']} with every peer, "
            f"median {phase['median_duration_s']}s, load {load:.2f}; failures {phase['failures']}"
        )
    print(
        json.dumps(
            {
                "bench": "sparta_rounds",
                "preset": swarm.config.name,
                "workers_per_stage": args.workers,
                "cpus": os.cpu_count(),
                "quiet_seconds": args.quiet,
                "churn_seconds": args.churn,
                "kills": len(kills),
                "quiet": {**quiet, "load_avg_1m": round(quiet_load, 2)},
                "churn": {**churn, "load_avg_1m": round(churn_load, 2)},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
