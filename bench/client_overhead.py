#!/usr/bin/env python3
"""What the Textual app costs a contributor: the joined worker's throughput with the app attached
against headless, side by side on one local swarm, and the app process's CPU share while it refreshes.

- swarm: `LocalSwarm` with the tiny preset (2 seeds, 1 worker per stage, 1 trainer, snapshot store and
  auth service), all real processes on 127.0.0.1.
- each run: one contributor joins it, started as a contributor starts it, all runs with one config dir
  (as a contributor who restarts the client):
  headless: `python3 agora_cli.py --headless --swarm URL --config-dir DIR` (tagged lines to a log file);
  app:      `python3 agora_cli.py --swarm URL --config-dir DIR` under a real pseudo-terminal (the bench
            drains the terminal's output and counts the bytes the app renders).
  Token in HF_TOKEN. Once the runtime reports Active, the run is measured for --seconds, then the
  contributor is stopped as a user stops it (`q` in the app, SIGINT headless) and must leave no process.
  Every run must join the same stage (the auth service gives the neediest one): when a stopped
  contributor's slot is still held, the bench reports it and restarts the auth service and snapshot
  store (a fresh slot book) before the next run.
- measured per run, over the same window:
  throughput: the joined worker's forward + backward requests per minute, from its `step` events in the
  client's JSONL event log (each event's rates times the time since the previous one = requests served);
  share: its part of all requests its stage served (the swarm's own workers' step events, same window),
  which machine load moves less than the throughput (a slower worker gets fewer requests routed to it);
  front-end CPU: user + system time of the front-end process (the app, or the headless printer) over
  wall time, in percent of one core, its children excluded; runtime CPU: the same for the runtime child
  and everything in its process group (p2pd included); swarm tokens/s: the trainer's progress lines;
  join time: from the contributor's start to Active (not in the measured window).
- modes alternate (headless, app, headless, app, ... --repeats pairs) and the summary holds medians, since
  the machine is shared. Last output line: one JSON object.

    python bench/client_overhead.py                        # ~9 min on a quiet 2-core machine, more under load
    python bench/client_overhead.py --seconds 30 --repeats 1
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _trainer_progress import ProgressRecorder, tokens_per_second  # noqa: E402

from agora_client.events import json_objects  # noqa: E402
from agora_client.frontend.supervisor import group_members  # noqa: E402
from agora_client.logs import logs_dir  # noqa: E402
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions  # noqa: E402

STOP_TIMEOUT_S = 45.0  # the runtime's graceful stop is bounded by 15 + 5 s, plus leftover cleanup
MODES = ("headless", "app")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds of each run, from Active on")
    parser.add_argument("--repeats", type=int, default=2, help="headless/app pairs to run (alternating)")
    parser.add_argument(
        "--join-timeout", type=float, default=240.0, help="seconds a contributor may take to reach Active"
    )
    parser.add_argument("--size", default="100x34", help="terminal size of the app, COLSxROWS")
    parser.add_argument("--pacing", type=float, default=2.0, help="auth service admission pacing (seconds)")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs go here (default: a temporary folder)")
    args = parser.parse_args()
    try:
        cols, rows = (int(part) for part in args.size.lower().split("x"))
    except ValueError:
        parser.error(f"--size {args.size!r}: expected COLSxROWS, for example 100x34")
    if cols < 20 or rows < 10:
        parser.error("--size: the app needs at least 20x10")
    if args.seconds <= 0 or args.repeats < 1 or args.join_timeout <= 0:
        parser.error("--seconds and --join-timeout must be positive, --repeats at least 1")
    args.cols, args.rows = cols, rows
    return args


@dataclass
class TerminalReader:
    """Drains a pseudo-terminal's master side (the app blocks when nobody reads) and counts bytes."""

    master: int
    total: int = 0

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._read, name="pty-reader", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: the last holder of the slave side is gone
                return
            if not chunk:
                return
            self.total += len(chunk)

    def join(self) -> None:
        self._thread.join(timeout=5)


def read_events(path: Path) -> list[dict]:
    return json_objects(path.read_text(errors="replace").splitlines())


class Contributor:
    """One contributor process (`agora_cli.py`, headless or the app), its runtime child, and how to stop them."""

    def __init__(self, mode: str, auth_url: str, token: str, config_dir: Path, log_path: Path, size: tuple[int, int]):
        self.mode, self.config_dir = mode, config_dir
        argv = [
            sys.executable,
            str(ROOT / "agora_cli.py"),
            "--cpu",
            "--swarm",
            auth_url,
            "--config-dir",
            str(config_dir),
            "--host-port",
            "0",
        ]
        env = {**os.environ, "HF_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        self.terminal: TerminalReader | None = None
        self.launched = time.time()  # the config dir's logs also hold earlier runs
        self._log = log_path.open("wb")
        if mode == "headless":
            self.proc = subprocess.Popen(
                [*argv, "--headless"],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
        else:
            master, slave = pty.openpty()
            cols, rows = size
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            env.update(TERM="xterm-256color", COLORTERM="truecolor")
            env.pop("NO_COLOR", None)
            self.proc = subprocess.Popen(
                argv,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )
            os.close(slave)
            self.terminal = TerminalReader(master)
        self.front = psutil.Process(self.proc.pid)
        self.runtime_pgid: int | None = None

    def events(self) -> list[dict]:
        """This run's runtime events, from the client's rotating JSONL logs (both modes write them)."""
        found = [event for path in sorted(logs_dir(self.config_dir).glob("*.jsonl")) for event in read_events(path)]
        return sorted((e for e in found if e.get("ts", 0.0) >= self.launched), key=lambda event: event["ts"])

    def find_runtime(self) -> int | None:
        """The runtime child's pid (= its process group: it runs in its own session)."""
        if self.runtime_pgid is None:
            try:
                children = self.front.children()
            except psutil.Error:
                return None
            if children:
                self.runtime_pgid = children[0].pid
        return self.runtime_pgid

    def wait_active(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.mode} contributor exited with {self.proc.returncode} before Active")
            events = self.events()
            failure = next((e for e in events if e.get("kind") == "exit"), None)
            if failure is not None:
                raise RuntimeError(f"the {self.mode} contributor's runtime exited before Active: {failure}")
            active = next((e for e in events if e.get("kind") == "sync" and e.get("phase") == "active"), None)
            if active is not None and self.find_runtime() is not None:
                return active
            time.sleep(0.5)
        raise RuntimeError(f"the {self.mode} contributor did not reach Active within {timeout:.0f}s")

    def cpu_seconds(self) -> tuple[float, dict[int, float]]:
        """(front-end process CPU s, {pid: CPU s} of the runtime's process group); children not included."""
        times = self.front.cpu_times()
        group = {}
        for process in group_members(self.find_runtime() or -1):
            try:
                cpu = process.cpu_times()
                group[process.pid] = cpu.user + cpu.system
            except psutil.Error:
                continue
        return times.user + times.system, group

    def stop(self) -> float:
        """Stop as a user does (`q` in the app, Ctrl-C headless); seconds it took.

        Kills what is left after a timeout."""
        started = time.monotonic()
        if self.proc.poll() is None:
            if self.terminal is not None:
                os.write(self.terminal.master, b"q")
            else:
                self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(
                f"  [WARNING] the {self.mode} contributor did not stop within {STOP_TIMEOUT_S:.0f}s: killing it",
                flush=True,
            )
        took = time.monotonic() - started
        self.kill_leftovers()
        return took

    def leftovers(self) -> list[int]:
        pids = [self.proc.pid] if self.proc.poll() is None else []
        if self.runtime_pgid is not None:
            pids += [process.pid for process in group_members(self.runtime_pgid)]
        return pids

    def kill_leftovers(self) -> None:
        for pgid in (self.runtime_pgid, self.proc.pid):
            if pgid is not None and group_members(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.terminal is not None:
            self.terminal.join()
            os.close(self.terminal.master)
        self._log.close()


def worker_throughput(events: list[dict], start: float, end: float) -> dict:
    """Requests served between the first and the last step event inside [start, end] (wall clock)."""
    steps = [e for e in events if e.get("kind") == "step" and start <= e["ts"] <= end]
    if len(steps) < 2 or steps[-1]["ts"] <= steps[0]["ts"]:
        return {
            "requests_per_min": 0.0,
            "forward_per_min": 0.0,
            "backward_per_min": 0.0,
            "epochs": len(steps),
            "stage": None,
        }
    forward = backward = 0.0
    for previous, step in pairwise(steps):
        minutes = (step["ts"] - previous["ts"]) / 60  # each event's rates cover the time since the previous one
        forward += step["forward_per_min"] * minutes
        backward += step["backward_per_min"] * minutes
    span = (steps[-1]["ts"] - steps[0]["ts"]) / 60
    return {
        "requests_per_min": (forward + backward) / span,
        "forward_per_min": forward / span,
        "backward_per_min": backward / span,
        "epochs": len(steps) - 1,
        "stage": steps[-1]["stage"],
    }


class JoinServices:
    """The swarm's auth service and snapshot store, restartable when a stopped contributor left its slot held."""

    def __init__(self, swarm: LocalSwarm, pacing: float):
        self.swarm, self.pacing = swarm, pacing
        self.url, self.token = swarm.start_join_services(pacing=pacing)

    def slots_held(self) -> int:
        return int(httpx.get(f"{self.url}/v1/status", timeout=10).json()["occupied"])

    def restart(self) -> None:
        assert self.swarm.auth is not None and self.swarm.snapshot_server is not None
        self.swarm.auth.stop()
        self.swarm.snapshot_server.close()
        self.url, self.token = self.swarm.start_join_services(pacing=self.pacing)


def measure(mode: str, index: int, swarm: LocalSwarm, recorder: ProgressRecorder, args, services: JoinServices) -> dict:
    run_dir: Path = swarm.options.run_dir
    held_before = services.slots_held()
    if held_before:  # the previous contributor's slot: the next joiner would get another stage
        print(
            f"  [WARNING] {held_before} slot(s) still held by stopped contributors: restarting the auth service",
            flush=True,
        )
        services.restart()
    contributor = Contributor(
        mode,
        services.url,
        services.token,
        run_dir / "client",
        run_dir / "logs" / f"client-{index}-{mode}.log",
        (args.cols, args.rows),
    )
    launched = time.monotonic()
    try:
        contributor.wait_active(args.join_timeout)
        join_s = time.monotonic() - launched
        wall0, mono0 = time.time(), time.monotonic()
        front0, group0 = contributor.cpu_seconds()
        bytes0 = contributor.terminal.total if contributor.terminal else 0
        while time.monotonic() - mono0 < args.seconds:
            if contributor.proc.poll() is not None:
                raise RuntimeError(f"the {mode} contributor exited with {contributor.proc.returncode} while measured")
            time.sleep(0.5)
        front1, group1 = contributor.cpu_seconds()
        bytes1 = contributor.terminal.total if contributor.terminal else 0
        wall1, mono1 = time.time(), time.monotonic()
        elapsed = mono1 - mono0
    finally:
        stop_s = contributor.stop()
    left = contributor.leftovers()
    held = services.slots_held()  # the stopped peer should have left its slot
    worker = worker_throughput(contributor.events(), wall0, wall1)
    peers = [  # the swarm's own workers of the joined stage, over the same window
        worker_throughput(read_events(path), wall0, wall1)["requests_per_min"]
        for path in sorted((run_dir / "events").glob(f"{worker['stage']}-*.jsonl"))
    ]
    stage_total = worker["requests_per_min"] + sum(peers)
    trainer = swarm.trainers[0]
    points = [p for p in recorder.of(trainer.name) if mono0 <= p.at <= mono1]
    config = swarm.config
    runtime_cpu = sum(group1[pid] - group0[pid] for pid in group1.keys() & group0.keys())
    result = {
        "mode": mode,
        "stage": worker["stage"],
        "join_s": round(join_s, 1),
        "measured_s": round(elapsed, 1),
        "epochs": worker["epochs"],
        "requests_per_min": round(worker["requests_per_min"], 1),
        "forward_per_min": round(worker["forward_per_min"], 1),
        "backward_per_min": round(worker["backward_per_min"], 1),
        "share_of_stage": round(worker["requests_per_min"] / stage_total, 3) if stage_total else None,
        "front_cpu_percent": round(100 * (front1 - front0) / elapsed, 1),
        "runtime_cpu_percent": round(100 * runtime_cpu / elapsed, 1),
        "swarm_tokens_per_s": round(tokens_per_second(points, config.optim.microbatch_size * config.model.seq_len), 1),
        "app_render_bytes_per_s": round((bytes1 - bytes0) / elapsed) if mode == "app" else None,
        "stop_s": round(stop_s, 1),
        "leftover_pids": left,
        "slots_held_after_stop": held,
    }
    print(f"  {json.dumps(result)}", flush=True)
    return result


def median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run[key] is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> int:
    args = parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="agora-bench-client-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    recorder = ProgressRecorder()
    options = SwarmOptions(workers_per_stage=1, trainers=1, run_dir=run_dir, publish_snapshots=True, report_every=2.0)
    runs: list[dict] = []
    print(f"[BENCH] starting the tiny swarm (1 worker per stage, 1 trainer); logs in {run_dir / 'logs'}", flush=True)
    started = time.monotonic()
    try:
        with LocalSwarm(options, on_line=recorder) as swarm:
            services = JoinServices(swarm, args.pacing)
            print(
                f"[BENCH] swarm up after {time.monotonic() - started:.0f}s; auth service at {services.url}", flush=True
            )
            for _ in range(args.repeats):
                for mode in MODES:
                    index = len(runs)
                    print(
                        f"[BENCH] run {index + 1}/{2 * args.repeats}: {mode}, {args.seconds:.0f}s from Active",
                        flush=True,
                    )
                    runs.append(measure(mode, index, swarm, recorder, args, services))
    except RuntimeError as error:  # a role or the contributor failed: its log says why
        print(f"[ERROR] {error}; logs in {run_dir / 'logs'}", flush=True)
        return 1
    swarm_left = swarm.leftover_pids()
    by_mode = {mode: [run for run in runs if run["mode"] == mode] for mode in MODES}
    headless_rate = median(by_mode["headless"], "requests_per_min")
    headless_share, app_share = median(by_mode["headless"], "share_of_stage"), median(by_mode["app"], "share_of_stage")
    app_rate = median(by_mode["app"], "requests_per_min")
    pair_ratios = [
        round(app["requests_per_min"] / headless["requests_per_min"], 3)
        for headless, app in zip(by_mode["headless"], by_mode["app"], strict=True)
        if headless["requests_per_min"] > 0
    ]
    result = {
        "bench": "client_overhead",
        "preset": "tiny",
        "cpu_cores": psutil.cpu_count(),
        "seconds_per_run": args.seconds,
        "repeats": args.repeats,
        "app_terminal": f"{args.cols}x{args.rows} pty",
        "headless_requests_per_min": headless_rate,
        "app_requests_per_min": app_rate,
        "throughput_ratio_app_over_headless": round(app_rate / headless_rate, 3) if headless_rate else None,
        "throughput_ratio_per_pair": pair_ratios,
        "headless_share_of_stage": headless_share,
        "app_share_of_stage": app_share,
        "share_ratio_app_over_headless": round(app_share / headless_share, 3) if headless_share and app_share else None,
        "app_cpu_percent": median(by_mode["app"], "front_cpu_percent"),
        "headless_front_cpu_percent": median(by_mode["headless"], "front_cpu_percent"),
        "runtime_cpu_percent_headless": median(by_mode["headless"], "runtime_cpu_percent"),
        "runtime_cpu_percent_app": median(by_mode["app"], "runtime_cpu_percent"),
        "swarm_tokens_per_s_headless": median(by_mode["headless"], "swarm_tokens_per_s"),
        "swarm_tokens_per_s_app": median(by_mode["app"], "swarm_tokens_per_s"),
        "app_render_bytes_per_s": median(by_mode["app"], "app_render_bytes_per_s"),
        "headless_join_s": median(by_mode["headless"], "join_s"),
        "app_join_s": median(by_mode["app"], "join_s"),
        "stages": sorted({run["stage"] for run in runs if run["stage"]}),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "slots_not_freed_on_stop": sum(run["slots_held_after_stop"] > 0 for run in runs),
        "leftover_processes": sum(len(run["leftover_pids"]) for run in runs) + len(swarm_left),
        "total_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
