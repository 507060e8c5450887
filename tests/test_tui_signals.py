"""The app as a real process on a pseudo-terminal: stop signals from outside (a service manager's
SIGTERM, `kill -INT`) stop the runtime gracefully, restore the terminal and exit with the documented code."""

from __future__ import annotations

import fcntl
import os
import pty
import shlex
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import psutil
import pytest

from agora_client.frontend.supervisor import INTERRUPT_TIMEOUT_S
from tests.replays import FIXTURES, ROOT

TOKEN = "hf_signalsSecret24680"
LEAVE_ALTERNATE_SCREEN = b"\x1b[?1049l"  # Textual's driver writes it when the app ends properly

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="pseudo-terminals and PDEATHSIG: Linux only"),
]


class Terminal:
    """A pseudo-terminal of a given size whose output is read (and kept) by a thread, so the app never blocks on it."""

    def __init__(self, columns: int = 80, rows: int = 24) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.output = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                return
            if not data:
                return
            with self._lock:
                self.output += data

    def text(self) -> bytes:
        with self._lock:
            return bytes(self.output)

    def close(self) -> None:
        for fd in (self.slave, self.master):
            try:
                os.close(fd)
            except OSError:
                pass
        self._thread.join(5)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_stops_the_runtime_restores_the_terminal_and_exits_with_the_documented_code(
    tmp_path, signum, expected
):
    runtime = shlex.join(
        [
            sys.executable,
            "-m",
            "agora_client.frontend.replay",
            str(FIXTURES / "sync1.jsonl"),
            "--hold",
            "--spawn-grandchild",
        ]
    )
    argv = [
        sys.executable,
        str(ROOT / "agora_cli.py"),
        "--config-dir",
        str(tmp_path / "config"),
        "--runtime-cmd",
        runtime,
    ]
    env = {
        **os.environ,
        "HF_TOKEN": TOKEN,
        "PYTHONPATH": str(ROOT),
        "TERM": "xterm-256color",
        "COLUMNS": "80",
        "LINES": "24",
    }
    terminal = Terminal()
    app = subprocess.Popen(
        argv, stdin=terminal.slave, stdout=terminal.slave, stderr=terminal.slave, env=env, cwd=tmp_path
    )
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while len(descendants) < 2 or b"Sync 1" not in terminal.text():
            assert app.poll() is None, terminal.text()[-2000:]
            assert time.monotonic() < deadline, "the app did not start the runtime and draw in time"
            descendants = psutil.Process(app.pid).children(recursive=True)  # the runtime stand-in and its daemon
            time.sleep(0.1)
        time.sleep(0.5)  # the grandchild has set up its own signal handling
        app.send_signal(signum)
        started = time.monotonic()
        code = app.wait(timeout=60)
        assert code == expected
        # The runtime obeyed SIGINT at once: the app must not sit out the timeout meant for one that does not
        # (its daemon, which ignores SIGINT and holds the runtime's pipes, is terminated once the runtime is gone).
        assert time.monotonic() - started < INTERRUPT_TIMEOUT_S
        after = terminal.text()
        assert LEAVE_ALTERNATE_SCREEN in after  # the terminal is back to normal, not left in the app's screen
        for process in descendants:
            assert gone(process.pid), f"{process.pid} outlived the app"
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
        for process in descendants:  # only what this test started, by pid
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        terminal.close()
