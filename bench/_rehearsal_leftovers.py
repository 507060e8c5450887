"""What the rehearsal (bench/rehearsal.py) left behind: processes, namespaces, qdiscs and /dev/shm files.

Other people's processes share this machine and its /dev/shm, so what counts is attributed to the run: every
process seen in the run's namespaces is sampled while it runs (pid and start time: a reused pid is not the same
process), and a /dev/shm file counts when torch named it after one of them (``torch_<pid>_...``).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import psutil

TORCH_SHM = re.compile(r"^torch_(\d+)_")
EXIT_WAIT_S = 30.0


class RunProcesses:
    """The processes that ran in the run's namespaces, sampled with ``sample()`` while they run."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}  # pid -> its start time

    def sample(self, namespaces: list[str]) -> None:
        for namespace in namespaces:
            listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
            for pid in map(int, listed.stdout.split()):
                try:
                    self.started.setdefault(pid, psutil.Process(pid).create_time())
                except psutil.Error:
                    continue

    def still_running(self) -> list[str]:
        """``pid name`` of each sampled process still running (a zombie counts: nobody reaped it)."""
        alive = []
        for pid, started in self.started.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == started:
                    alive.append(f"{pid} {process.name()}")
            except psutil.Error:
                continue
        return alive

    def wait_gone(self, timeout_s: float) -> None:
        """Give the processes killed a moment ago (the namespaces' removal SIGKILLs what is left) time to exit."""
        deadline = time.monotonic() + timeout_s
        while self.still_running() and time.monotonic() < deadline:
            time.sleep(0.5)


def tbf_qdiscs(namespace: str) -> int:
    shown = subprocess.run(["ip", "-n", namespace, "qdisc", "show"], capture_output=True, text=True, timeout=30)
    return shown.stdout.count("qdisc tbf")


def shm_files_of(pids: set[int]) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if (m := TORCH_SHM.match(name)) and int(m.group(1)) in pids]


def leftovers(namespaces: list[str], processes: RunProcesses, root: Path) -> dict:
    """Counted once everything was stopped and the namespaces deleted; each must be 0."""
    netns = Path("/var/run/netns")
    present = sorted(set(os.listdir(netns)) & set(namespaces)) if netns.is_dir() else []
    processes.wait_gone(EXIT_WAIT_S)
    ours = {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}
    named = [  # a process of the run that escaped its namespace would still name the run's directory
        f"{process.info['pid']} {process.info['name']}"
        for process in psutil.process_iter(["pid", "name", "cmdline"])
        if process.info["pid"] not in ours and str(root) in " ".join(process.info["cmdline"] or [])
    ]
    left = sorted(set(processes.still_running()) | set(named))
    return {
        "processes": len(left),
        "processes_left": left[:10],
        "namespaces": len(present),
        "qdiscs": sum(tbf_qdiscs(namespace) for namespace in present),
        "dev_shm_files": len(shm_files_of(set(processes.started))),
    }
