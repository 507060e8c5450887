"""Child processes that die with their parent.

hivemind forks helper processes (connection handlers, task pools, the DHT, the averager). If the
worker's main process is killed outright they would live on, still accepting requests they can
never answer, so trainers would see a hung worker instead of a dead one. On Linux every process
forked after ``die_with_parent()`` gets SIGKILL when the thread that forked it exits.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have every process this one forks from now on killed when this process dies (Linux only)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    forking = [0]  # pid of the process that is forking (the hook is inherited by children that fork again)

    def before() -> None:
        forking[0] = os.getpid()

    def in_child() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != forking[0]:  # the parent died between fork and prctl
            os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)
