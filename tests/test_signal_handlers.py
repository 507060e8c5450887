"""Signal handlers take no lock: a signal that lands while the main thread is inside ``Event.wait`` (holding the
event's lock) must not hang the process. A child polls its event in a tight loop, the way a role's main loop
does, while this test signals it round after round at whatever point the loop has reached."""

from __future__ import annotations

import queue
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 200  # the old handlers (an Event.set inside the handler) hung within the first few rounds, every run
ROUND_TIMEOUT_S = 10.0  # a round takes milliseconds; a deadlocked handler never ends it

_CHILD = """
import signal, sys, threading
sys.path.insert(0, {root!r})
from agora_client.system.lifetime import on_signals, stop_on_signals
{setup}
for round in range({rounds}):
    {arm}
    print("armed", round, flush=True)
    while not event.wait(0):  # polls: most of the time goes to the wait's own code, which holds its lock
        pass
    print("seen", round, flush=True)
"""


def _signal_every_round(setup: str, arm: str, signum: int) -> None:
    """Run the child; each round send ``signum`` once the event is armed and expect the loop to see it."""
    code = _CHILD.format(root=str(ROOT), setup=setup, arm=arm, rounds=ROUNDS)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in process.stdout], daemon=True).start()
    try:
        for round in range(ROUNDS):
            assert _next_line(lines) == f"armed {round}"
            time.sleep(random.uniform(0.0, 0.002))  # spreads where in the loop the signal lands; no result rests on it
            process.send_signal(signum)
            line = _next_line(lines)
            assert line == f"seen {round}", (
                f"round {round}: the child did not see the signal within {ROUND_TIMEOUT_S:.0f}s (got {line!r}, "
                f"exit code {process.poll()}): its handler deadlocked or the process died"
            )
        assert process.wait(ROUND_TIMEOUT_S) == 0  # it ended by itself, not through a second signal's exit
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _next_line(lines: queue.Queue[str]) -> str | None:
    try:
        return lines.get(timeout=ROUND_TIMEOUT_S)
    except queue.Empty:
        return None


def test_a_stop_signal_anywhere_in_the_main_loop_never_hangs_the_role():
    # Re-armed each round: the same handler's second signal would end the process at once.
    _signal_every_round(setup="", arm="event = stop_on_signals()", signum=signal.SIGINT)


def test_a_signal_that_sets_an_event_never_hangs_the_loop_that_waits_on_and_clears_it():
    # The runtime's "retry now" (SIGUSR1): the loop clears the event, which takes its lock too.
    _signal_every_round(
        setup="event = threading.Event(); on_signals((signal.SIGUSR1,), event.set)",
        arm="event.clear()",
        signum=signal.SIGUSR1,
    )


_STOPPING_CHILD = """
import sys, threading
sys.path.insert(0, {root!r})
from agora_client.system import lifetime
lifetime.STUCK_STOP_S = 1.0
stop = lifetime.stop_on_signals()
print("ready", flush=True)
stop.wait()
def shutdown_that_never_ends():
    threading.Event().wait()
{stopping}
"""


def _dumped(stderr: str) -> bool:
    """The stacks of the main thread, in the stop that never ends, and of another thread are there."""
    return "in shutdown_that_never_ends" in stderr and "in <module>" in stderr and stderr.count("Thread 0x") >= 2


def _stop(stopping: str) -> tuple[subprocess.Popen, str]:
    """Start a role that runs ``stopping`` once asked to stop, ask it, and return it with its stderr until it ends
    or has the stacks of a stop that never ends (bounded)."""
    code = _STOPPING_CHILD.format(root=str(ROOT), stopping=stopping)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in process.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(signal.SIGINT)
    text, deadline = "", time.monotonic() + 60
    while not _dumped(text) and time.monotonic() < deadline:
        with suppress(queue.Empty):
            line = lines.get(timeout=0.5)
            if line is None:
                break
            text += line
    return process, text


def test_a_stop_that_hangs_prints_every_threads_stack_and_one_that_ends_prints_none():
    process, stderr = _stop("shutdown_that_never_ends()")
    try:
        assert stderr.startswith("Timeout (0:00:01)!") and _dumped(stderr), stderr
    finally:
        process.kill()
        process.wait()
    process, stderr = _stop("")
    assert process.wait(ROUND_TIMEOUT_S) == 0 and "Timeout" not in stderr, stderr
