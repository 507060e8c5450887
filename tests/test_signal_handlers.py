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
