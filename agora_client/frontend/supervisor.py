"""The worker runtime as a child process: started in its own session, read line by line,
stopped gracefully, and never left behind.

Stopping: SIGINT to the child (the runtime frees its slot, leaves the roster and its averaging group,
then finishes the current request and stops, within RUNTIME_STOP_S at any stage size), then SIGTERM
(its second stop signal: it exits at once), then SIGKILL to its whole group, each after a bounded
wait. Only the child itself is interrupted: its helper processes must stay up while it shuts them
down in order (they die with it if it is killed). Whatever
is left in the group after the child exits (p2pd, say) is terminated the same way.
This module has no Textual import: the app and the headless client share it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Literal, Mapping

import psutil

from agora_client.system.agora_command import AGORA

Stream = Literal["stdout", "stderr", "oversize"]
LINE_LIMIT = 1 << 20  # a longer stdout line is reported as malformed, not buffered
RUNTIME_STOP_S = 10.0  # what the runtime promises for a graceful stop (the slot is free within its first seconds)
INTERRUPT_TIMEOUT_S = RUNTIME_STOP_S
TERMINATE_TIMEOUT_S = 3.0  # a second stop signal makes the runtime exit at once: only a hung process needs longer
GROUP_LEFTOVER_TIMEOUT_S = 3.0
_POLL_S = 0.05
_EXIT_POLL_S = 0.25  # while reading: how often to look whether the child itself has exited
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildCommand:
    """What to run: argv, extra environment (merged over ours) and working directory."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # repr=False: it may hold HF_TOKEN
    cwd: str | None = None

    def describe(self) -> str:
        return " ".join(self.argv)


def runtime_command(
    *,
    token: str,
    swarm: str | None = None,
    gpu: int | None = None,
    cpu: bool = False,
    config_dir: Path | None = None,
    monitor: str | None = None,
    host_port: int | None = None,
    announce_addr: str | None = None,
    port_mapping: bool = True,
    retry_every: float | None = None,
    insecure: bool = False,
    ca_cert: Path | None = None,
    yield_args: tuple[str, ...] = (),
    max_upload_mbit: float = 0.0,
) -> ChildCommand:
    """The real runtime: ``agora runtime [--swarm URL] [--gpu N | --cpu] [--config-dir D] [--monitor URL] [--host-port
    P] [--announce-addr HOST:PORT] [--no-port-mapping] [--retry-every S] [--insecure] [--ca-cert PEM]
    [--max-upload-mbit N]`` and ``yield_args`` (--yield, --active-hours, --yield-grace), token in HF_TOKEN."""
    argv = [*AGORA, "runtime"]
    argv += _run_flags(swarm, gpu, cpu, config_dir, monitor)
    argv += _reachability_flags(host_port, announce_addr, port_mapping)
    argv += yield_args
    argv += _join_flags(retry_every, insecure, ca_cert)
    if max_upload_mbit:
        argv += ["--max-upload-mbit", repr(float(max_upload_mbit))]
    return ChildCommand(tuple(argv), {"HF_TOKEN": token, "PYTHONUNBUFFERED": "1"})


def _run_flags(
    swarm: str | None, gpu: int | None, cpu: bool, config_dir: Path | None, monitor: str | None
) -> list[str]:
    """The runtime's flags for the swarm to join, the device to train on, its config folder and the monitor."""
    flags = []
    if swarm:
        flags += ["--swarm", swarm]
    if gpu is not None:
        flags += ["--gpu", str(gpu)]
    if cpu:
        flags += ["--cpu"]
    if config_dir is not None:
        flags += ["--config-dir", str(config_dir)]
    if monitor:
        flags += ["--monitor", monitor]
    return flags


def _reachability_flags(host_port: int | None, announce_addr: str | None, port_mapping: bool) -> list[str]:
    """The runtime's flags for how the swarm reaches this worker: its port, announced address and port mapping."""
    flags = []
    if host_port is not None:
        flags += ["--host-port", str(host_port)]
    if announce_addr:
        flags += ["--announce-addr", announce_addr]
    if not port_mapping:
        flags += ["--no-port-mapping"]
    return flags


def _join_flags(retry_every: float | None, insecure: bool, ca_cert: Path | None) -> list[str]:
    """The runtime's flags for the wait between join attempts, plain http:// to the swarm, and a CA to trust."""
    flags = []
    if retry_every is not None:
        flags += ["--retry-every", repr(float(retry_every))]
    if insecure:
        flags += ["--insecure"]
    if ca_cert is not None:
        flags += ["--ca-cert", str(ca_cert)]
    return flags


def _stop_when_front_end_dies() -> None:
    """In the child, before exec: SIGTERM (a graceful stop) when the front end dies without stopping it
    (its terminal closed: SIGHUP kills the front end before any cleanup runs). Linux only."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


async def _pump(reader: asyncio.StreamReader, name: Stream, queue: asyncio.Queue[tuple[Stream, str] | None]) -> None:
    """Put each line of ``reader`` on ``queue`` as (name, line), then None once the stream is closed."""
    try:
        while True:
            try:
                raw = await reader.readline()
            except ValueError:  # longer than LINE_LIMIT: asyncio dropped it
                await queue.put(("oversize", ""))
                continue
            if not raw:
                break
            await queue.put((name, raw.decode("utf-8", errors="replace").rstrip("\r\n")))
    finally:
        await queue.put(None)


class RuntimeProcess:
    """One run of the child. ``start``, iterate ``lines()``, then ``wait()``; ``stop()`` any time."""

    def __init__(
        self,
        command: ChildCommand,
        *,
        interrupt_timeout_s: float = INTERRUPT_TIMEOUT_S,
        terminate_timeout_s: float = TERMINATE_TIMEOUT_S,
    ) -> None:
        self.command = command
        self.interrupt_timeout_s = interrupt_timeout_s
        self.terminate_timeout_s = terminate_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self.stop_requested = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        return self._process.returncode if self._process else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        """Start the child; OSError (no such program, say) propagates to the caller."""
        self._process = await asyncio.create_subprocess_exec(
            *self.command.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.command.env},
            cwd=self.command.cwd,
            start_new_session=True,  # its own process group: our terminal's Ctrl-C does not reach it
            limit=LINE_LIMIT,
            preexec_fn=_stop_when_front_end_dies,
        )

    async def lines(self) -> AsyncIterator[tuple[Stream, str]]:
        """(stream, line) from stdout and stderr as they come, until both are closed."""
        assert self._process is not None and self._process.stdout and self._process.stderr
        queue: asyncio.Queue[tuple[Stream, str] | None] = asyncio.Queue()

        async def clear_leftovers() -> None:
            # What the child left in its group (a daemon that inherited our pipes) would keep the streams
            # open for ever once the child is gone: terminate it, as wait() does, so that they end.
            await self._exited(None, _EXIT_POLL_S)
            await self._clear_group()

        pumps = [
            asyncio.create_task(_pump(self._process.stdout, "stdout", queue)),
            asyncio.create_task(_pump(self._process.stderr, "stderr", queue)),
        ]
        reaper = asyncio.create_task(clear_leftovers())
        try:
            open_streams = len(pumps)
            while open_streams:
                item = await queue.get()
                if item is None:
                    open_streams -= 1
                else:
                    yield item
        finally:
            for task in (*pumps, reaper):
                task.cancel()

    async def _exited(self, timeout: float | None, poll_s: float = _POLL_S) -> bool:
        """True once the child itself has exited. Not ``Process.wait()``: that also waits until every copy
        of its pipes is closed, which a leftover in its group (or one that ignores SIGINT) may delay for ever."""
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._process.returncode is None:
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    async def wait(self) -> int:
        """The child's exit code, once it and everything left in its group are gone."""
        assert self._process is not None
        code = await self._process.wait()
        await self._clear_group()
        self._close_pipes()
        return code

    async def stop(self) -> int | None:
        """Graceful stop: SIGINT, then SIGTERM to the child, then SIGKILL to its group, each after a bounded wait."""
        if self._process is None:
            return None
        self.stop_requested = True
        steps = (
            (signal.SIGINT, self.interrupt_timeout_s),
            (signal.SIGTERM, self.terminate_timeout_s),
            (signal.SIGKILL, None),
        )
        for signum, timeout in steps:
            if self._process.returncode is not None:
                break
            if signum == signal.SIGKILL:
                self._signal_group(signum)
            else:
                self._signal_child(signum)
            await self._exited(timeout)
        await self._clear_group()
        self._close_pipes()
        return self._process.returncode

    def _close_pipes(self) -> None:
        # asyncio offers no public close for a subprocess transport; without it, a transport whose
        # pipes were not read to EOF is closed by the garbage collector after its loop is gone.
        transport = getattr(self._process, "_transport", None)
        if transport is not None:
            transport.close()

    async def aclose(self) -> None:
        """Abrupt end (the app is closing without a graceful stop): SIGKILL the group, reap, close pipes."""
        if self._process is None:
            return
        if self._process.returncode is None:
            self.kill()
        await self.wait()

    def kill(self) -> None:
        """Last resort when no event loop is left to wait in: SIGKILL the whole group now."""
        if self._process is not None:
            self._signal_group(signal.SIGKILL)

    def hurry(self) -> None:
        """A second stop request: give the runtime its second stop signal now (it exits at once)."""
        if self.running and self.stop_requested:
            self._signal_child(signal.SIGTERM)

    def retry_now(self) -> None:
        """Ask the runtime to retry its join at once (it waits between attempts while unreachable)."""
        if self.running:
            self._signal_child(signal.SIGUSR1)

    def _signal_child(self, signum: int) -> None:
        assert self._process is not None
        try:
            os.kill(self._process.pid, signum)
        except ProcessLookupError:
            pass

    def _signal_group(self, signum: int) -> None:
        assert self._process is not None
        try:
            os.killpg(self._process.pid, signum)  # pgid == pid: start_new_session made it a group leader
        except (ProcessLookupError, PermissionError):
            pass

    async def _clear_group(self) -> None:
        """Terminate, then kill, what the child left in its group (daemons it started)."""
        assert self._process is not None
        pgid = self._process.pid
        for signum in (signal.SIGTERM, signal.SIGKILL):
            if not group_members(pgid):
                return
            self._signal_group(signum)
            deadline = asyncio.get_running_loop().time() + GROUP_LEFTOVER_TIMEOUT_S
            while group_members(pgid) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(_POLL_S)
