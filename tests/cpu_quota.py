"""CPU quotas on one machine: each worker gets a capacity of its own, as on a host of its own.

On a shared machine, a worker that waits frees CPU for the others, so a slow worker never costs the
swarm what it would across real hosts. A cgroup per worker with a CFS quota (``cpus`` cores at most)
removes that coupling::

    with CpuQuotas("agi15-1234") as quotas:
        with quotas.group("body1-0", 0.3).entered():  # processes started here, and their children, get 0.3 cores
            worker = subprocess.Popen(...)

``entered()`` moves the calling process into the group, so a process started inside inherits it, then
moves it back. A ``Group`` is a Placement for ``LocalSwarm(place_worker=...)``. Every group made is removed
on exit, even on failure: processes still in it are moved back to where this process started, then the
group directory is deleted. Needs root and the cgroup v1 ``cpu`` hierarchy (``cpu.cfs_quota_us``), as on
these machines; a cgroup v2-only machine is not supported yet (its no-internal-processes rule needs a
delegated subtree). ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _own_cpu_cgroup() -> Path | None:
    """This process's cgroup directory in the v1 hierarchy that has the cpu controller."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if (CGROUP_ROOT / name / "cpu.cfs_quota_us").exists():
                    return CGROUP_ROOT / name / path.lstrip("/")
    return None


def unavailable() -> str | None:
    """Why CPU quotas cannot be set here (None when they can)."""
    if os.geteuid() != 0:
        return "cgroups need root (CI runs as root)"
    home = _own_cpu_cgroup()
    if home is None:
        return "no cgroup v1 hierarchy with the cpu controller is mounted under /sys/fs/cgroup"
    if not os.access(home, os.W_OK):
        return f"{home} is not writable (a container without cgroup delegation?)"
    return None


@dataclass(frozen=True)
class Group:
    path: Path
    home: Path  # the cgroup this process came from
    address: str = "127.0.0.1"

    def entered(self):
        return _moved(self.path, self.home)

    def pids(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def throttled_s(self) -> float:
        """Seconds its processes were held back by the quota so far (shows the quota binds)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["throttled_time"]) / 1e9


@contextmanager
def _moved(group: Path, home: Path) -> Iterator[None]:
    (group / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))


class CpuQuotas:
    def __init__(self, prefix: str):
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot set CPU quotas: {reason}")
        self.home = _own_cpu_cgroup()
        self.prefix = prefix
        self.groups: list[Group] = []

    def group(self, name: str, cpus: float, address: str = "127.0.0.1") -> Group:
        """A new cgroup limited to ``cpus`` cores (0.3: 30 ms of CPU time per 100 ms)."""
        if cpus <= 0:
            raise ValueError("a CPU quota must be above 0 cores")
        path = self.home / f"{self.prefix}-{name}"
        path.mkdir()
        group = Group(path, self.home, address)
        self.groups.append(group)  # before the quota: a group made is removed even if writing it fails
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(1000, round(cpus * PERIOD_US))))
        return group

    def close(self) -> None:
        for group in self.groups:
            for _ in range(50):  # bounded: a process may be forking while we move the others out
                try:
                    pids = group.pids()
                except FileNotFoundError:
                    break
                for pid in pids:
                    try:
                        (self.home / "cgroup.procs").write_text(str(pid))
                    except ProcessLookupError:
                        pass  # exited meanwhile
                try:
                    group.path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.groups = [group for group in self.groups if group.path.exists()]
        if self.groups:
            raise RuntimeError(f"cgroups left behind: {', '.join(str(group.path) for group in self.groups)}")

    def __enter__(self) -> "CpuQuotas":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
