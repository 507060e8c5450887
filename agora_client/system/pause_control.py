"""`agora pause` / `agora resume`: the contributor pauses its running runtime from another terminal, or the app.

The runtime listens on a unix socket in its config dir, ``control/<cpu|gpuN>.sock`` (one per GPU, named as the
event logs are): the folder is 0700 and the socket 0600, so only the contributor's own account can pause it. A
socket rather than a control file, so that the command knows at once whether a runtime runs and what it did. A
command is one line (``pause`` or ``resume``), the answer one JSON line. A pause is a yield
(agora_client/system/gpu_yield.py, agora_client/joining/yield_control.py): the worker drains and earns nothing,
keeps its slot for ``--yield-grace`` and then gives it back; a resume serves again, or joins again.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
from dataclasses import dataclass
from pathlib import Path

from agora_client.logs import log_name
from agora_client.system.gpu_yield import YieldPolicy

COMMANDS = ("pause", "resume")
ANSWER_TIMEOUT_S = 5.0
MAX_LINE = 64
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class PauseControlError(RuntimeError):
    """The control socket cannot be opened or reached; the message says why."""


@dataclass(frozen=True)
class Answer:
    """What one runtime answered: ``ok`` is False for a command it did not understand."""

    runtime: str  # cpu, gpu0, ...
    ok: bool
    changed: bool
    message: str


def control_dir(config_dir: Path) -> Path:
    return config_dir / "control"


def socket_path(config_dir: Path, gpu: int | None) -> Path:
    return control_dir(config_dir) / f"{log_name(gpu)}.sock"


def _answer(policy: YieldPolicy, command: str) -> dict:
    if command == "pause":
        changed = policy.pause()
        message = "paused: the worker finishes what it serves and drains" if changed else "already paused"
    elif command == "resume":
        changed = policy.resume()
        message = "resumed: the worker serves again (it may sync first)" if changed else "not paused"
    else:
        return {"ok": False, "changed": False, "message": f"unknown command {command[:MAX_LINE]!r}: pause or resume"}
    return {"ok": True, "changed": changed, "message": message}


class _Handler(socketserver.StreamRequestHandler):
    timeout = ANSWER_TIMEOUT_S  # a client that sends nothing does not hold the control for long

    def handle(self) -> None:
        try:
            line = self.rfile.readline(MAX_LINE)
            command = line.decode("utf-8", errors="replace").strip()
            self.wfile.write(json.dumps(_answer(self.server.policy, command)).encode() + b"\n")
        except OSError:  # the client went away or timed out: nothing to answer
            return


class _Server(socketserver.UnixStreamServer):
    def __init__(self, path: Path, policy: YieldPolicy):
        self.policy = policy
        super().__init__(str(path), _Handler)


class PauseServer:
    """The runtime's end: answers ``pause`` and ``resume`` by pausing or resuming ``policy``, from its own thread."""

    def __init__(self, config_dir: Path, gpu: int | None, policy: YieldPolicy):
        self.path = socket_path(config_dir, gpu)
        self.policy = policy
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen; PauseControlError when another runtime of this config dir and GPU answers there already."""
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise PauseControlError(f"the config dir's path is too long for a control socket: {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.parent.chmod(0o700)
        if self.path.exists() or self.path.is_symlink():
            if _answers(self.path):
                raise PauseControlError(f"another runtime of this config dir and GPU listens on {self.path}")
            self.path.unlink()  # left by a runtime that was killed
        self._server = _Server(self.path, self.policy)
        self.path.chmod(0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="pause-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)
        self._server = None


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(ANSWER_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def running_runtimes(config_dir: Path) -> list[Path]:
    """The control sockets of the config dir, one per runtime that ran (a killed one's may be left)."""
    folder = control_dir(config_dir)
    return sorted(folder.glob("*.sock")) if folder.is_dir() else []


def toggle(path: Path) -> Answer | None:
    """Pause the runtime, or resume it when it is paused already (the app's key); None when none listens."""
    answer = send(path, "pause")
    if answer is not None and answer.ok and not answer.changed:
        return send(path, "resume")
    return answer


def send(path: Path, command: str) -> Answer | None:
    """Send ``command`` to the runtime listening on ``path``; None when none listens there."""
    runtime = path.stem
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(ANSWER_TIMEOUT_S)
        try:
            connection.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        except OSError as error:
            raise PauseControlError(f"cannot reach the runtime at {path}: {error}") from error
        try:
            connection.sendall(command.encode() + b"\n")
            reply = connection.makefile("rb").readline(4096)
        except OSError as error:
            raise PauseControlError(f"the runtime at {path} did not answer: {error}") from error
    try:
        answer = json.loads(reply)
        return Answer(runtime, bool(answer["ok"]), bool(answer["changed"]), str(answer["message"]))
    except (ValueError, KeyError, TypeError) as error:
        raise PauseControlError(f"the runtime at {path} answered something else than a control answer") from error
