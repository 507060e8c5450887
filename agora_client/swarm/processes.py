"""Child processes of a local swarm, each in its own process group so that stopping one also stops
its p2p daemon and helper processes, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import psutil

from agora_client.system.agora_command import AGORA

CLI = list(AGORA)


class ManagedProcess:
    """A role started as ``<program> <args>`` (``agora`` unless ``program`` says otherwise, e.g. a test's own
    entry point wrapping it); its output goes to a log file, line by line through ``on_line``."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: Path,
        *,
        on_line: Callable[[str, str], None] | None = None,
        env: dict[str, str] | None = None,
        program: Sequence[str] = CLI,
    ):
        self.name, self.log_path = name, log_path
        self._on_line = on_line
        self._ready_marks: dict[str, threading.Event] = {}
        self._lines: list[str] = []
        self._lock = threading.Lock()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("a", buffering=1)
        self.proc = subprocess.Popen(
            [*program, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,  # own process group: p2pd and hivemind's forks go with it
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.pgid = self.proc.pid
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self._log.write(line + "\n")
            with self._lock:
                self._lines.append(line)
                for mark, event in self._ready_marks.items():
                    if mark in line:
                        event.set()
            if self._on_line is not None:
                self._on_line(self.name, line)
        self._log.close()

    def wait_for(self, mark: str, timeout: float) -> str:
        """Block until a line containing ``mark`` appears; return that line."""
        with self._lock:
            for line in self._lines:
                if mark in line:
                    return line
            event = self._ready_marks.setdefault(mark, threading.Event())
        deadline = time.monotonic() + timeout
        while not event.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{self.name} {state} before printing {mark!r}; see {self.log_path}")
        with self._lock:
            return next(line for line in self._lines if mark in line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill_main(self, signum: int = signal.SIGKILL) -> None:
        """Signal only the role's main process (simulates a crash: its p2pd is orphaned until stop())."""
        if self.alive:
            os.kill(self.proc.pid, signum)

    def group_pids(self) -> list[int]:
        return group_pids(self.pgid)

    def stop(self, grace: float = 10.0) -> None:
        """SIGINT the role (it shuts its helpers down in order), then SIGKILL its group after ``grace`` seconds."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.alive or self.group_pids()):
            time.sleep(0.1)
        _signal_group(self.pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=5)


def group_pids(pgid: int) -> list[int]:
    """The processes still in process group ``pgid``."""
    pids = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                pids.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return pids


def stop_group(pgid: int, grace: float = 10.0) -> None:
    """Stop a role this process did not start (its leader's pid is ``pgid``): SIGINT its leader, SIGKILL its group
    after ``grace`` seconds."""
    if pgid in group_pids(pgid):  # the leader itself, not a process that took its pid later
        _signal_group_leader(pgid, signal.SIGINT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and group_pids(pgid):
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)


def _signal_group_leader(pgid: int, signum: int) -> None:
    try:
        os.kill(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(processes: Sequence[ManagedProcess], grace: float = 10.0) -> None:
    """Stop processes concurrently (each may take its grace period)."""
    threads = [threading.Thread(target=process.stop, args=(grace,)) for process in processes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
