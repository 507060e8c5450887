"""`agora deploy up`: start this host's roles step by step, each step once the one before is ready; keep them up.

In the foreground (the default) Ctrl-C or SIGTERM stops every role, and so does `agora deploy down`, which
sends SIGTERM. ``--detach`` runs the same supervisor in the background and returns once every role is ready.
Each role's output goes to ``<run dir>/logs/<role>.log``.

A role that fails (a nonzero exit, a signal) is started again alone after ``RESTART_AFTER_S``, as its systemd unit
(`agora deploy units`, Restart=on-failure) would be; the others keep running. A role that fails ``CRASH_LOOP_LIMIT``
times within ``CRASH_LOOP_WINDOW_S`` stops the host: starting it again will not heal it. A role that exits 0 on its
own is left stopped, as its unit would be.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from agora_client.swarm.processes import CLI, ManagedProcess, stop_all

from .plan import Launch, Step
from .spec import DeploySpec
from .state import read_state, state_path, supervisor_alive, write_state

START_TIMEOUT = 300.0  # a role that prints no ready line within this is taken as failed
LOG_TAIL_LINES = 20
RESTART_AFTER_S = 10.0  # a failed role's next start, here and in its systemd unit (RestartSec)
CRASH_LOOP_LIMIT, CRASH_LOOP_WINDOW_S = 5, 600.0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def supervise(spec: DeploySpec, host_name: str, steps: list[Step]) -> int:
    """Start every step, then wait for Ctrl-C, SIGTERM or a role's exit; stop every role on the way out."""
    path = state_path(spec, host_name)
    previous = read_state(path)
    if previous is not None and supervisor_alive(previous):
        print(
            f"[ERROR] host {host_name} is up already (supervisor pid {previous['supervisor']}): "
            "run agora deploy down first",
            flush=True,
        )
        return 1
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    processes: list[ManagedProcess] = []
    roles: list[dict] = []
    try:
        for step in steps:
            _start_step(spec, step, processes, roles, path)
        write_state(path, os.getpid(), roles, ready=True)
        print(
            f"[DEPLOY] up: {len(processes)} roles on {host_name}; logs in {spec.run.dir / 'logs'}; "
            "Ctrl-C or agora deploy down stops them",
            flush=True,
        )
        return _watch(spec, [launch for step in steps for launch in step], processes, roles, path)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as error:  # a role exited or timed out before it was ready
        print(f"[ERROR] {error}", flush=True)
        return 1
    finally:
        print(f"[DEPLOY] stopping {len(processes)} roles...", flush=True)
        stop_all(processes)
        left = [pid for process in processes for pid in process.group_pids()]
        path.unlink(missing_ok=True)
        print(f"[DEPLOY] stopped{f'; processes still running: {left}' if left else ''}", flush=True)


def _start(spec: DeploySpec, launch: Launch) -> ManagedProcess:
    return ManagedProcess(launch.name, launch.args, spec.run.dir / "logs" / f"{launch.name}.log")


def _start_step(spec: DeploySpec, step: Step, processes: list[ManagedProcess], roles: list[dict], path: Path) -> None:
    started = []
    for launch in step:
        process = _start(spec, launch)
        started.append((launch, process))
        processes.append(process)
        roles.append({"name": launch.name, "pgid": process.pgid, "address": launch.address})
        write_state(path, os.getpid(), roles, ready=False)  # `down` finds a role even while the start goes on
    for launch, process in started:
        process.wait_for(launch.ready, START_TIMEOUT)
        print(f"[DEPLOY] {launch.name} ready: {launch.address}", flush=True)


def _watch(
    spec: DeploySpec, launches: list[Launch], processes: list[ManagedProcess], roles: list[dict], path: Path
) -> int:
    """Start failed roles again until the supervisor is interrupted (KeyboardInterrupt); 1 on a crash loop, 0 once
    every role has exited 0 on its own. ``processes``, ``roles`` and the state file follow each new start."""
    failures: dict[str, list[float]] = {}
    running = set(range(len(processes)))
    while running:
        time.sleep(1.0)
        for index in sorted(running):
            process = processes[index]
            if process.alive:
                continue
            code = process.proc.returncode
            if code == 0:
                print(f"[DEPLOY] {process.name} exited on its own (0): not started again", flush=True)
                running.discard(index)
                continue
            now = time.monotonic()
            failures[process.name] = [t for t in failures.get(process.name, []) if now - t < CRASH_LOOP_WINDOW_S]
            failures[process.name].append(now)
            print(f"[ERROR] {process.name} exited with {code}; see {process.log_path}", flush=True)
            if len(failures[process.name]) >= CRASH_LOOP_LIMIT:
                print(
                    f"[ERROR] {process.name} failed {CRASH_LOOP_LIMIT} times within {CRASH_LOOP_WINDOW_S:.0f} s: "
                    "stopping the host",
                    flush=True,
                )
                return 1
            _restart(spec, launches[index], index, processes, roles, path)
    return 0


def _restart(
    spec: DeploySpec, launch: Launch, index: int, processes: list[ManagedProcess], roles: list[dict], path: Path
) -> None:
    """The failed role's helpers reaped (a p2p daemon may hold its port), a wait, then the role started again."""
    processes[index].stop(grace=5.0)
    print(f"[DEPLOY] starting {launch.name} again in {RESTART_AFTER_S:.0f} s", flush=True)
    time.sleep(RESTART_AFTER_S)
    processes[index] = process = _start(spec, launch)  # from here on a stop of the host stops it too
    roles[index]["pgid"] = process.pgid
    write_state(path, os.getpid(), roles, ready=False)  # `down` finds the new group even while it starts
    process.wait_for(launch.ready, START_TIMEOUT)  # RuntimeError: the host stops, as at its first start
    write_state(path, os.getpid(), roles, ready=True)
    print(f"[DEPLOY] {launch.name} ready again: {launch.address}", flush=True)


def start_detached(spec: DeploySpec, host_name: str, file: Path) -> int:
    """Run ``agora deploy up`` in the background; return once every role is ready (0) or it failed (1)."""
    log = spec.run.dir / "logs" / f"deploy-{host_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        supervisor = subprocess.Popen(
            [*CLI, "deploy", "up", str(file), "--host", host_name],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    path = state_path(spec, host_name)
    while True:
        state = read_state(path)
        if state is not None and state["ready"] and state["supervisor"] == supervisor.pid:
            for role in state["roles"]:
                print(f"[DEPLOY] {role['name']} ready: {role['address']}", flush=True)
            print(
                f"[DEPLOY] up in the background (pid {supervisor.pid}, log {log}); agora deploy down stops it",
                flush=True,
            )
            return 0
        if supervisor.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            print(
                "\n".join([f"[ERROR] agora deploy up failed (exit {supervisor.returncode}); the end of {log}:", *tail])
            )
            return 1
        time.sleep(0.5)
