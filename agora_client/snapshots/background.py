"""Writing a stage's state without stalling its requests: a copy into host memory that only steps wait for,
then the write (serialize, fsync, hash, upload), both in a background thread, one at a time.

The host buffers are kept between writes (a stage's state is tens of GB at full size: allocating them
every time would cost as much as the copy), pinned when the stage lives on a GPU so the device-to-host
copy runs asynchronously at full PCIe speed. Snapshots and checkpoints share one ``BackgroundWriter`` per
worker, so one set of buffers: while either is being written, the other waits or is skipped (its caller
decides). Modelled on torch.distributed.checkpoint's ``async_save``: stage to host, then persist.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import torch
from torch import nn

from .format import StageState, live_state

WRITER_NICENESS = 10  # the writer yields the CPU (and, by default, the disk) to the requests it runs beside


class HostCopy:
    """Host buffers holding a consistent copy of a stage's state, reused from one copy to the next.

    Only a GPU run can confirm what this does on CUDA: the buffers are pinned (``pin_memory``) and the copy
    runs on a side stream with ``non_blocking=True``, synchronized before ``take`` returns.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, live: StageState) -> StageState:
        """Copy ``live`` (caller holds the stage's state lock) into the buffers; returns the state they hold."""
        sources = {**_prefixed("params.", live.params), **_prefixed("optimizer.", live.optimizer)}
        cuda = next((tensor.device for tensor in sources.values() if tensor.is_cuda), None)
        self._buffers = {key: self._buffer(key, tensor, pinned=cuda is not None) for key, tensor in sources.items()}
        if cuda is None:
            for key, tensor in sources.items():
                self._buffers[key].copy_(tensor)
        else:
            self._copy_on_side_stream(sources, cuda)
        return StageState(
            {key: self._buffers[f"params.{key}"] for key in live.params},
            {key: self._buffers[f"optimizer.{key}"] for key in live.optimizer},
            live.optimizer_meta,
        )

    def _buffer(self, key: str, like: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.shape == like.shape and buffer.dtype == like.dtype:
            return buffer
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned and torch.cuda.is_available())

    def _copy_on_side_stream(self, sources: dict[str, torch.Tensor], device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        # The copy starts after every kernel queued so far on the caller's stream, so it reads the weights of the
        # last step, not ones still being written. That this covers the stage's work (hivemind's runtime and the
        # optimizer queue on the default stream, no stream of their own) is for a GPU run to confirm.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for key, tensor in sources.items():
                self._buffers[key].copy_(tensor, non_blocking=True)
        stream.synchronize()  # before the lock is released: the next step may overwrite what is still being read


class BackgroundWriter:
    """At most one write of the stage's state in flight. ``submit`` takes ``state_lock`` (held by whatever changes
    the weights or the optimizer state, never by requests), and a thread copies the state into host memory, lets
    the lock go, then writes the copy at a lower CPU priority."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, state_lock: threading.Lock):
        self.module, self.optimizer, self.state_lock = module, optimizer, state_lock
        self.copy = HostCopy()
        self.last_lock_hold_s: float | None = None  # how long the last copy held the state lock (a step waits as long)
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self, what: str, write: Callable[[StageState], None], on_failure: Callable[[str, Exception], None]
    ) -> bool:
        """Start copying and writing the state in the background, or return False while a write is in flight.

        The copy is of the state as it is now: no step can come between this call and the copy. ``write(copy)``
        persists it; ``on_failure(what, error)`` reports a write that raised. The buffers are free again either way.
        """
        if self.busy:  # without waiting for the lock
            return False
        self.state_lock.acquire()  # released by the writer thread once its copy is taken
        if self.busy:  # another submitter's write started while this one waited
            self.state_lock.release()
            return False
        self._thread = threading.Thread(
            target=self._copy_and_write,
            args=(time.monotonic(), what, write, on_failure),
            name=f"write-{what}",
            daemon=True,
        )
        try:
            self._thread.start()
        except BaseException:
            self.state_lock.release()
            raise
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the write in flight (at most ``timeout`` seconds); True once none is in flight."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy

    def _copy_and_write(
        self,
        acquired: float,
        what: str,
        write: Callable[[StageState], None],
        on_failure: Callable[[str, Exception], None],
    ) -> None:
        try:
            try:
                state = self.copy.take(live_state(self.module, self.optimizer))
            finally:
                self.state_lock.release()
                self.last_lock_hold_s = time.monotonic() - acquired
            _lower_own_priority()  # only now: a step may be waiting for the copy
            write(state)
        except Exception as error:  # a full disk or an unreachable bucket must not stop training; the caller says so
            on_failure(what, error)


def _lower_own_priority() -> None:
    """Raise this thread's nice value. On Linux a thread id is a valid PRIO_PROCESS target and the change is this
    thread's alone (elsewhere it would be the whole process's, so nothing is changed there). Linux derives the
    I/O priority from the nice value unless one was set (ioprio_set(2)), so the disk is yielded too."""
    if not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + WRITER_NICENESS))
    except OSError:  # a sandbox that forbids it: the write still runs, at normal priority
        pass


def _prefixed(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}{key}": tensor for key, tensor in tensors.items()}
