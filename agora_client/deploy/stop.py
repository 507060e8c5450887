"""`agora deploy down`: stop what `agora deploy up` started on this host, gracefully, then by force."""

from __future__ import annotations

import os
import signal
import threading
import time

from agora_client.swarm.processes import group_pids, stop_group

from .spec import DeploySpec
from .state import read_state, state_path, supervisor_alive

SUPERVISOR_MARGIN_S = 15.0  # beyond the roles' own grace: the supervisor stops them all at once, then exits


def down(spec: DeploySpec, host_name: str, grace: float) -> int:
    """SIGTERM the supervisor (it stops every role in order); then stop whatever is left of each role's group."""
    path = state_path(spec, host_name)
    state = read_state(path)
    if state is None:
        print(f"[DEPLOY] nothing runs from this deploy file on {host_name} (no {path})", flush=True)
        return 0
    if supervisor_alive(state):
        os.kill(state["supervisor"], signal.SIGTERM)
        deadline = time.monotonic() + grace + SUPERVISOR_MARGIN_S
        while supervisor_alive(state) and time.monotonic() < deadline:  # a zombie counts as gone: its parent reaps it
            time.sleep(0.2)
    pgids = [role["pgid"] for role in state["roles"]]
    threads = [threading.Thread(target=stop_group, args=(pgid, grace)) for pgid in pgids]  # a supervisor killed by
    for thread in threads:  # force leaves its roles running: stop them here
        thread.start()
    for thread in threads:
        thread.join()
    left = [pid for pgid in pgids for pid in group_pids(pgid)]
    path.unlink(missing_ok=True)
    names = ", ".join(role["name"] for role in state["roles"])
    print(f"[DEPLOY] stopped {names or 'nothing'}{f'; processes still running: {left}' if left else ''}", flush=True)
    return 1 if left else 0
