"""Child processes that die with their parent, and the graceful stop every role shares.

hivemind forks helper processes (connection handlers, task pools, the DHT, the averager). If the
worker's main process is killed outright they would live on, still accepting requests they can
never answer, so trainers would see a hung worker instead of a dead one. On Linux every process
forked after ``die_with_parent()`` gets SIGKILL when the thread that forked it exits.
"""

from __future__ import annotations

import collections
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import NoReturn

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


_children_reset_registered = False
# a graceful stop still under way this long after its signal is stuck somewhere: every thread's stack goes to stderr,
# once, before a supervisor's next signal (frontend/supervisor.py RUNTIME_STOP_S, 10 s) ends the process
STUCK_STOP_S = 8.0
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_fork_masks = threading.local()  # the forking thread's signal mask, restored after the fork


def _block_stop_signals() -> None:
    # Until the child has its own handlers, a SIGTERM sent to it (a task pool ended right after it
    # started) would reach our inherited handler and be lost; blocked, it waits for the child's default.
    _fork_masks.before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def _unblock_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, _fork_masks.before)


def _reset_signals_in_child() -> None:
    # A forked helper (task pool, connection handler) must not inherit our stop handler: it would
    # swallow the SIGTERM its owner uses to end it. Ctrl-C on the terminal reaches the whole group;
    # helpers ignore it and let the main process shut them down in order.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _unblock_stop_signals()


class _SignalRelay:
    """Runs what signal handlers ask for on a thread of its own, so that no handler takes a lock.

    A Python signal handler runs in the main thread between two bytecodes, maybe while that thread holds a lock
    (inside ``Event.wait`` or ``Event.clear``, a logging handler, ``Queue.put``): a handler that takes the same lock
    waits for its own thread forever. A handler here only appends to a deque and writes a byte to a pipe, neither
    of which takes a lock; this thread, woken by the byte, runs the action.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._actions: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)  # a handler must never block
        threading.Thread(target=self._run, name="signal-relay", daemon=True).start()

    def call(self, action: Callable[[], None]) -> None:
        """From a signal handler: run ``action`` on the relay thread."""
        self._actions.append(action)
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups the thread has not read yet: it will come
            pass

    def _run(self) -> None:
        while True:
            os.read(self._wake_read, 512)
            while self._actions:
                action = self._actions.popleft()
                try:
                    action()
                except Exception:  # one failed action must not end the thread every later signal needs
                    logging.getLogger(__name__).exception("a signal's action failed")


_relay: _SignalRelay | None = None


def _signal_relay() -> _SignalRelay:
    """This process's relay, started before any handler needs it (a forked child has none of its parent's threads)."""
    global _relay
    if _relay is None or _relay.pid != os.getpid():
        _relay = _SignalRelay()
    return _relay


def on_signals(signums: Iterable[int], action: Callable[[], None]) -> None:
    """Run ``action`` (such as an event's ``set``) each time one of ``signums`` arrives, outside the signal handler.

    Every handler that does more than record a value goes through here: see _SignalRelay for why.
    """
    relay = _signal_relay()
    for signum in signums:
        signal.signal(signum, lambda signum, frame: relay.call(action))


def stop_on_signals() -> threading.Event:
    """An event the first SIGINT or SIGTERM sets, for a graceful stop; a second one ends the process at once. A stop
    that takes more than STUCK_STOP_S prints every thread's stack to stderr, so that a hung stop says where it hangs.

    Call it first thing in a role's ``run``: processes forked later get the default SIGTERM and ignore SIGINT.
    """
    global _children_reset_registered
    stop = threading.Event()
    relay = _signal_relay()
    asked = False

    def begin_stop() -> None:
        faulthandler.dump_traceback_later(STUCK_STOP_S)  # a watchdog thread in C: it runs while Python is stuck too
        stop.set()

    def handle(signum: int, frame: object) -> None:
        nonlocal asked
        if asked or stop.is_set():  # asked twice: stop now (forked helpers die with us, see die_with_parent)
            os._exit(128 + signum)
        asked = True
        relay.call(begin_stop)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handle)
    if not _children_reset_registered:
        os.register_at_fork(
            before=_block_stop_signals, after_in_parent=_unblock_stop_signals, after_in_child=_reset_signals_in_child
        )
        _children_reset_registered = True
    return stop


def exit_process(code: int) -> NoReturn:
    """Leave now, after a role has shut everything down in order.

    The interpreter's teardown would garbage-collect hivemind objects (P2P, its daemon client) after
    their event loop is gone, and their ``__del__`` prints errors about it; there is nothing left for
    that teardown to do.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader went away
            pass
    os._exit(code)
