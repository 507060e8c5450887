"""A forked child that runs torch ops on several threads at once (hivemind's averager compressing parts) must find
torch's thread pool: rebuilt by ``rebuild_torch_thread_pool`` before its threads start."""

from __future__ import annotations

import os
import threading

import torch

from agora_client.engine.averaging import rebuild_torch_thread_pool

CHILDREN, THREADS = 40, 8


def _child_ops_fail() -> bool:
    """In a fresh fork: THREADS threads start a parallel torch op at the same moment; whether any raised."""
    rebuild_torch_thread_pool()
    failed, start = [], threading.Barrier(THREADS)

    def work() -> None:
        start.wait()
        try:
            (torch.ones(1 << 22) * 3).to(torch.bfloat16).sum()
        except RuntimeError as error:  # "Invalid thread pool!" without the rebuild
            failed.append(error)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return bool(failed)


def test_threads_of_a_forked_child_find_torchs_thread_pool() -> None:
    threads_before, failures = torch.get_num_threads(), 0
    torch.set_num_threads(1)  # as a worker or test peer sets it: every new thread then sets its count too
    try:
        (torch.ones(1 << 22) * 3).sum()  # the parent's pool exists, so each child inherits it marked corrupt
        for _ in range(CHILDREN):
            pid = os.fork()
            if pid == 0:
                os._exit(1 if _child_ops_fail() else 0)
            _, status = os.waitpid(pid, 0)
            failures += os.waitstatus_to_exitcode(status) != 0
    finally:
        torch.set_num_threads(threads_before)  # the rest of the suite runs as before
    assert failures == 0, f"{failures} of {CHILDREN} forked children lost torch's thread pool"
