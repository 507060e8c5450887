"""Seconds from `python3 agora_cli.py demo` to Active, and where they went: the first command a newcomer runs.

Runs the demo exactly as the README says, in headless mode (`demo --headless`), in a run directory of its own.
The swarm's start is timed from the demo's own "[DEMO] swarm up" line; every later phase from the client's
runtime events (``<run dir>/client/logs/cpu.jsonl``: the events the app shows, with their timestamps). Once the
worker is Active the demo gets Ctrl-C (SIGINT), as a user would stop it, and must end within ``--stop-timeout``.

Phases, each from the end of the one before:
  swarm          launch -> the swarm is up (seeds, auth, snapshots, workers, trainer, monitor)
  client         -> the runtime's first event (the client and its runtime started)
  authorization  -> authorized (preflight, the port, the dial-back, the join)
  download       -> the snapshot downloaded and verified
  worker         -> sync phase 1 begins (the worker built and started, its wait for a calm moment in the stage)
  sync1          -> sync phase 2 begins
  sync2          -> Active

Also the stage epochs the worker's snapshot trailed its stage by when sync 1 began (tiny passes phase 1 at once
at most ``sync.max_allowed_stale`` behind).

Usage: python bench/demo_time.py [--timeout 600] [--stop-timeout 30]
Prints one line per phase; the last line is one JSON object with ``to_active_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SWARM_UP = "[DEMO] swarm up"
PHASES = ("swarm", "client", "authorization", "download", "worker", "sync1", "sync2")


def _events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    events = []
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written right now
            continue
        events.append(record)
    return events


def _first(events: list[dict], kind: str, **match) -> float | None:
    found = next((e for e in events if e.get("kind") == kind and all(e.get(k) == v for k, v in match.items())), None)
    return None if found is None else found["ts"]


def _marks(events: list[dict]) -> dict[str, float | None]:
    """Wall-clock time at which each phase ended, from the runtime's events."""
    return {
        "client": events[0]["ts"] if events else None,
        "authorization": _first(events, "auth", status="authorized"),
        "download": _first(events, "download", status="done"),
        "worker": _first(events, "sync", phase="sync1"),
        "sync1": _first(events, "sync", phase="sync2"),
        "sync2": _first(events, "sync", phase="active"),
    }


class _Demo:
    """The demo in a process group of its own; its stdout read line by line with the time each arrived."""

    def __init__(self, run_dir: Path):
        command = [sys.executable, str(REPO / "agora_cli.py"), "demo", "--headless", "--run-dir", str(run_dir)]
        self.started = time.time()
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.swarm_up: float | None = None
        self.tail: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if self.swarm_up is None and line.startswith(SWARM_UP):
                self.swarm_up = time.time()
            self.tail = [*self.tail[-40:], line.rstrip()]

    def interrupt(self, timeout: float) -> float | None:
        """Ctrl-C as a user presses it; seconds until the demo ended, None if it did not (then it is killed)."""
        started = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout)
            return time.monotonic() - started
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None


def _wait_for_active(demo: _Demo, log: Path, deadline: float) -> dict[str, float | None]:
    while time.monotonic() < deadline and demo.process.poll() is None:
        marks = _marks(_events(log))
        if marks["sync2"] is not None:
            return marks
        time.sleep(1.0)  # polls a file the runtime appends to; the wait itself is bounded by the deadline
    return _marks(_events(log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for Active")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds Ctrl-C may take")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agora-demo-time-") as scratch:
        run_root = Path(scratch) / "runs"
        demo = _Demo(run_root)
        try:
            log = _client_log(run_root, demo, time.monotonic() + 120)
            marks = _wait_for_active(demo, log, time.monotonic() + args.timeout)
        finally:
            stop_s = demo.interrupt(args.stop_timeout) if demo.process.poll() is None else None
        ends = {"swarm": demo.swarm_up, **marks}
        report(demo.started, ends, stop_s, demo.tail, weights_lag(_events(log)))


def _client_log(run_root: Path, demo: _Demo, deadline: float) -> Path:
    """The client's event log of this run, once the demo has named its run directory."""
    while time.monotonic() < deadline and demo.process.poll() is None:
        runs = [path for path in run_root.glob("*") if path.is_dir()]
        if runs:
            return runs[0] / "client" / "logs" / "cpu.jsonl"
        time.sleep(0.5)
    raise SystemExit(f"the demo made no run directory under {run_root}:\n" + "\n".join(demo.tail))


def weights_lag(events: list[dict]) -> int | None:
    """Stage epochs between the snapshot the worker loaded and sync 1's start: at most sync.max_allowed_stale
    (tiny: 5), phase 1 passes at once, else it lasts its epochs."""
    restored = next((e for e in events if e.get("kind") == "log" and e["message"].startswith("restored ")), None)
    sync1 = next((e for e in events if e.get("kind") == "sync" and e.get("phase") == "sync1"), None)
    if restored is None or sync1 is None:
        return None
    return sync1["local_epoch"] - int(restored["message"].rsplit(" ", 1)[-1])


def report(
    started: float, ends: dict[str, float | None], stop_s: float | None, tail: list[str], lag: int | None
) -> None:
    phases, previous = {}, started
    for phase in PHASES:
        end = ends[phase]
        if end is None:
            print(f"{phase:<14} not reached")
            continue
        phases[phase] = round(end - previous, 1)
        print(f"{phase:<14} {phases[phase]:7.1f} s   (at {end - started:6.1f} s)")
        previous = end
    to_active = None if ends["sync2"] is None else round(ends["sync2"] - started, 1)
    if to_active is None:
        print("the demo did not reach Active; its last lines:\n" + "\n".join(tail), file=sys.stderr)
    print(f"weights lag at sync 1: {lag} stage epochs")
    print(
        json.dumps(
            {
                "to_active_s": to_active,
                "phases_s": phases,
                "weights_lag_at_sync1_epochs": lag,
                "ctrl_c_stop_s": stop_s and round(stop_s, 1),
            }
        )
    )
    if to_active is None or stop_s is None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
