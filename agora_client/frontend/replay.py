"""Replays a recorded event stream (JSONL) as if it were the runtime: the child the tests and
demos run in place of ``agora runtime``.

    python -m agora_client.frontend.replay FILE [--delay S] [--hold] [--exit-code N] [--ignore-sigint]
        [--spawn-grandchild] [--on-retry FILE]

Lines go to stdout unchanged (malformed ones too), one every ``--delay`` seconds. ``--hold`` keeps
running after the last line, like a live worker. SIGINT makes it exit 0 after an ``exit`` event,
the way the runtime stops gracefully, unless ``--ignore-sigint``. ``--spawn-grandchild`` starts a
process in the same group that ignores SIGINT, standing in for p2pd. ``--on-retry FILE`` plays FILE
when SIGUSR1 comes (the app's "retry the join now" key) while holding, the way the runtime retries.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from agora_client.system.lifetime import on_signals

_GRANDCHILD = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(3600)"


def _stopped() -> int:
    print(
        json.dumps({"v": 1, "ts": time.time(), "kind": "exit", "code": 0, "reason": "stopped by request"}), flush=True
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agora_client.frontend.replay", description="replay a recorded event stream"
    )
    parser.add_argument("file", type=Path)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between lines")
    parser.add_argument("--hold", action="store_true", help="keep running after the last line")
    parser.add_argument("--exit-code", type=int, default=0, help="exit code after the last line (without --hold)")
    parser.add_argument("--repeat", type=int, default=1, help="play the file this many times")
    parser.add_argument("--stderr", default="", help="a line written to stderr after the last line")
    parser.add_argument("--ignore-sigint", action="store_true")
    parser.add_argument("--spawn-grandchild", action="store_true")
    parser.add_argument(
        "--on-retry", type=Path, metavar="FILE", help="play FILE when SIGUSR1 asks for a retry (with --hold)"
    )
    args = parser.parse_args(argv)
    stop = threading.Event()  # SIGINT: the lines stop, and an exit event ends the stream
    if args.ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        on_signals((signal.SIGINT,), stop.set)
    retries: list[int] = []  # SIGUSR1 arrivals not played yet; the handler only counts, the loop below writes
    if args.on_retry is not None:
        signal.signal(signal.SIGUSR1, lambda signum, frame: retries.append(signum))
    if args.spawn_grandchild:
        subprocess.Popen([sys.executable, "-c", _GRANDCHILD], stdin=subprocess.DEVNULL)
    try:
        lines = args.file.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        print(f"replay: cannot read {args.file}: {error}", file=sys.stderr)
        return 2
    for _ in range(args.repeat):
        if not _play(lines, args.delay, stop):
            return _stopped()
    if args.stderr:
        print(args.stderr, file=sys.stderr, flush=True)
    if args.hold:
        return _hold(args.on_retry, args.delay, stop, retries)
    return args.exit_code


def _hold(on_retry: Path | None, delay: float, stop: threading.Event, retries: list[int]) -> int:
    """Keep running after the last line, like a live worker: play ``on_retry`` at each SIGUSR1, until SIGINT."""
    while not stop.wait(0.05):
        if retries and on_retry is not None:
            retries.clear()
            if not _play(on_retry.read_text(encoding="utf-8").splitlines(), delay, stop):
                break
    return _stopped()


def _play(lines: list[str], delay: float, stop: threading.Event) -> bool:
    """Write ``lines`` to stdout, ``delay`` seconds apart; False as soon as ``stop`` is set."""
    for line in lines:
        if stop.is_set():
            return False
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        if delay and stop.wait(delay):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
