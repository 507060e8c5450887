"""Where a contributor's join spent its time, from the timestamps of the runtime's own events (bench/join_time.py
and bench/rehearsal.py; not a bench itself).

Start-up (to the first preflight check: imports, the run description), preflight, opening the worker's port (the
router's mapping and the worker's DHT), authorization with the dial-back (every try: a home the swarm could not
reach waits and tries again, through the relay), the join queue, the snapshot download, the worker's start (and
within it the wait for a calm moment in the stage, see WorkerNode.start), sync phase 1, and sync phase 2 until the
first processed batch.
"""

from __future__ import annotations


def first(events: list[dict], kind: str, **match) -> dict | None:
    return next((e for e in events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())), None)


def first_batch(events: list[dict]) -> dict | None:
    return next((e for e in events if e["kind"] == "step" and (e["forward_per_min"] or e["backward_per_min"])), None)


def snapshot_epoch(events: list[dict]) -> int:
    """The epoch of the snapshot the worker's weights came from (its DOWNLOAD line: "restored ... at epoch N")."""
    restored = next(e for e in events if e["kind"] == "log" and e["message"].startswith("restored "))
    return int(restored["message"].rsplit(" ", 1)[-1])


def join_phases(events: list[dict], started: float) -> dict:
    """Seconds of each step of a join that reached its first batch; ``started``: the wall-clock time of the start.

    Raises StopIteration or TypeError for a join that did not get that far."""
    preflights = [e for e in events if e["kind"] == "preflight" and e["check"] != "reachability"]
    opening = first(events, "reachability", status="checking")
    authorizing = first(events, "auth", status="authorizing")["ts"]
    authorized = first(events, "auth", status="authorized")["ts"]
    # a joiner admitted at once gets one queue event (position 0) after the fact: that is no time in a queue
    queued = next((e for e in events if e["kind"] == "queue" and e["position"] > 0), None)
    download_start, download_done = (
        first(events, "download", status="started"),
        first(events, "download", status="done"),
    )
    sync1, sync2, batch = (
        first(events, "sync", phase="sync1"),
        first(events, "sync", phase="sync2"),
        first_batch(events),
    )
    worker_up = next(
        e for e in events if e["kind"] == "log" and e["tag"] == "JOIN" and e["message"].startswith("Worker up")
    )
    return {
        "startup_and_description_s": round(preflights[0]["ts"] - started, 2),
        "preflight_s": round(preflights[-1]["ts"] - preflights[0]["ts"], 2),
        "open_port_s": round(opening["ts"] - preflights[-1]["ts"], 2),
        "authorization_with_dial_back_s": round((queued["ts"] if queued else authorized) - authorizing, 2),
        "queue_s": round(authorized - queued["ts"], 2) if queued else 0.0,
        "download_s": round(download_done["ts"] - download_start["ts"], 2),
        "worker_start_s": round(sync1["ts"] - download_done["ts"], 2),
        "of_which_calm_moment_wait_s": round(sync1["ts"] - worker_up["ts"], 2),  # sync 1 begins early in a stage epoch
        # phase 1 passes at once for weights at most sync.max_allowed_stale epochs behind (tiny), else lasts its epochs
        "weights_lag_at_sync1_epochs": sync1["local_epoch"] - snapshot_epoch(events),
        "sync1_s": round(sync2["ts"] - sync1["ts"], 2),
        "sync2_until_first_batch_s": round(batch["ts"] - sync2["ts"], 2),
        "start_to_first_batch_s": round(batch["ts"] - started, 2),
        "download_bytes": download_done["bytes"],
    }
