"""tests/cpu_quota.py: a quota binds a process and the children it forks, and every cgroup is removed."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_quota import CpuQuotas, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

SPIN_S = 2.0
# a parent and the child it forks, both spinning for SPIN_S seconds of wall time; the parent reaps the child
SPINNERS = f"""
import os, time
child = os.fork()
end = time.monotonic() + {SPIN_S}
while time.monotonic() < end:
    pass
if child:
    os.waitpid(child, 0)
"""


def _cpu_cgroup(pid: int | str = "self") -> str:
    return next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if "cpu" in line.split(":")[1].split(",")
    )


def test_a_quota_caps_a_process_and_the_children_it_forks():
    home = _cpu_cgroup()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with CpuQuotas(f"agora-test-{os.getpid()}") as quotas:
        group = quotas.group("spin", 0.2)
        with group.entered():
            assert _cpu_cgroup() == home + ("" if home.endswith("/") else "/") + group.path.name
            spinners = subprocess.Popen([sys.executable, "-c", SPINNERS])
        assert _cpu_cgroup() == home  # only the process started inside stays in the group
        assert spinners.wait(timeout=30) == 0
        throttled = group.throttled_s()
        path = group.path
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    # Unthrottled, the two spinners take up to 2 x SPIN_S of CPU on 2 cores; the quota allows 0.2 x SPIN_S in all.
    assert throttled > 0
    assert cpu_s < 0.2 * SPIN_S * 1.5
    assert not path.exists()


def test_every_group_is_removed_even_when_the_run_fails_with_a_process_inside():
    sleeper = None
    try:
        with pytest.raises(RuntimeError, match="the bench failed"):
            with CpuQuotas(f"agora-test-{os.getpid()}") as quotas:
                group = quotas.group("sleeper", 0.5)
                with group.entered():
                    sleeper = subprocess.Popen(["sleep", "30"])
                assert group.pids() == [sleeper.pid]
                raise RuntimeError("the bench failed")
        assert not group.path.exists()
        assert sleeper.poll() is None and _cpu_cgroup(sleeper.pid) == _cpu_cgroup()  # moved out, not killed
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait(timeout=10)


def test_a_quota_must_be_positive():
    with CpuQuotas(f"agora-test-{os.getpid()}") as quotas:
        with pytest.raises(ValueError, match="above 0 cores"):
            quotas.group("none", 0)
        assert quotas.groups == []
