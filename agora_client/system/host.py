"""Host probes (psutil): the worker's process-tree memory, host RAM and CPU share."""

from __future__ import annotations

import psutil


class HostProbe:
    """Samples one process and its descendants (the worker and its p2pd daemon, say)."""

    def __init__(self, pid: int | None = None) -> None:
        self._process = psutil.Process(pid)
        # cpu_percent(interval=None) compares with the previous call: prime it once so the first sample is real.
        self._process.cpu_percent(interval=None)

    def process_tree_rss(self) -> int:
        try:
            processes = [self._process, *self._process.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.Error:  # exited or not ours between listing and reading
                continue
        return total

    def cpu_percent(self) -> float | None:
        try:
            return self._process.cpu_percent(interval=None)
        except psutil.Error:
            return None

    @staticmethod
    def host_ram() -> tuple[int, int]:
        """(used, total) bytes of the machine's RAM."""
        memory = psutil.virtual_memory()
        return int(memory.total - memory.available), int(memory.total)
