"""A SPARTA peer in a process of its own, on a host of its own (a network namespace), driven by JSON lines.

The namespaced SPARTA test and bench/sparta_8b.py run it; ``SpartaPeer`` is the parent's side::

    ip netns exec NS python -m tests.sparta_peer --address 10.78.0.2 --index 1 --stage-size 3 --initial-peer MADDR \
        [--max-upload-mbit N]

It starts a hivemind DHT on its address (the first peer has no --initial-peer: it bootstraps the others) and
says {"event": "dht", "maddrs": [...]}. Then it reads one command a line on stdin and answers on stdout
(hivemind logs to stderr):

- {"cmd": "open", "prefix": P, "values": N, "sparta": {SpartaConfig fields}} -> {"event": "opened"}: a
  SpartaAverager over one flat float32 parameter of N values (no model), replacing the previous averager;
- {"cmd": "round", "round": K} -> {"event": "round", "report": {RoundReport fields}, "link": {"up": .., "down": ..}}
  once round K ended (link: the rates it announced to that round's group, bytes/s);
- {"cmd": "close"} -> {"event": "closed", "peak_rss_mb": {"peer": .., "averager": ..}}: the averager stops.

At the end of its input it stops everything and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _emit(**event: Any) -> None:
    print(json.dumps(event, default=str), flush=True)


def _flat_parameter(values: int, index: int):
    import torch

    data = torch.randn(values, generator=torch.Generator().manual_seed(0))
    data.mul_(1 + 0.01 * (index + 1))  # replicas close to each other but not equal, as after training apart
    return torch.nn.Parameter(data)


class _Peer:
    """The peer process's state: its DHT, its parameter and the SpartaAverager open over it."""

    def __init__(self, args: argparse.Namespace):
        from hivemind import DHT

        self.args = args
        self.dht = DHT(initial_peers=args.initial_peer, host_maddrs=[f"/ip4/{args.address}/tcp/0"], start=True)
        self.parameter = None
        self.averager = None
        self.lock = threading.Lock()

    def open(self, prefix: str, values: int, sparta: dict) -> None:
        from agora_client.averaging.sparta import SpartaAverager
        from agora_client.config import SpartaConfig
        from agora_client.upload_cap import UploadCap

        self.close()
        if self.parameter is None or self.parameter.numel() != values:
            self.parameter = None  # the old one goes before the new one is allocated
            self.parameter = _flat_parameter(values, self.args.index)
        stage_size = self.args.stage_size
        self.averager = SpartaAverager(
            self.dht,
            prefix,
            [self.parameter],
            SpartaConfig(**sparta),
            lock=self.lock,
            stage_size=lambda: stage_size,
            upload=UploadCap(self.args.max_upload_mbit) if self.args.max_upload_mbit else None,
        )

    def round(self, round_no: int) -> tuple[dict, dict]:
        """The round's report, and the link this peer announced to its group."""
        link = self.averager.announced_link.to_json()
        return dataclasses.asdict(self.averager.begin_round(round_no, 1.0).result()), link

    def close(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None

    def shutdown(self) -> None:
        self.close()
        self.dht.shutdown()


def _peak_rss_mb() -> dict[str, float]:
    # ru_maxrss is in KiB on Linux; "averager" is the largest child waited for: hivemind's averager process
    return {
        "peer": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "averager": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }


def _serve(peer: _Peer) -> None:
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "open":
            peer.open(command["prefix"], command["values"], command["sparta"])
            _emit(event="opened")
        elif command["cmd"] == "round":
            report, link = peer.round(command["round"])
            _emit(event="round", report=report, link=link)
        elif command["cmd"] == "close":
            peer.close()
            _emit(event="closed", peak_rss_mb=_peak_rss_mb())
        else:
            raise ValueError(f"unknown command {command['cmd']!r}: use open, round or close")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="this host's address, the DHT listens on it")
    parser.add_argument("--index", type=int, required=True, help="this peer's number (its values differ a little)")
    parser.add_argument("--stage-size", type=int, required=True, help="peers of the stage: a group is full with them")
    parser.add_argument("--initial-peer", action="append", default=[], help="a DHT address of the bootstrap peer")
    parser.add_argument("--max-upload-mbit", type=float, default=0.0, help="this peer's upload cap (0: none)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    peer = _Peer(args)
    try:
        _emit(event="dht", maddrs=[str(maddr) for maddr in peer.dht.get_visible_maddrs()])
        _serve(peer)
    finally:
        peer.shutdown()
    return 0


class PeerFailed(RuntimeError):
    pass


class SpartaPeer:
    """The parent's side of one peer process started in ``namespace``; its stderr goes to ``log_path``."""

    def __init__(
        self,
        namespace: str,
        address: str,
        index: int,
        stage_size: int,
        initial_peers: list[str],
        log_path: Path,
        max_upload_mbit: float = 0.0,
    ):
        self.index, self.log_path = index, log_path
        command = [
            "ip",
            "netns",
            "exec",
            namespace,
            sys.executable,
            "-m",
            "tests.sparta_peer",
            "--address",
            address,
            "--index",
            str(index),
            "--stage-size",
            str(stage_size),
        ]
        for maddr in initial_peers:
            command += ["--initial-peer", maddr]
        if max_upload_mbit:
            command += ["--max-upload-mbit", str(max_upload_mbit)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self._events: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"sparta-peer-{index}", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a stray print of a library: not ours
            if isinstance(event, dict) and "event" in event:
                self._events.put(event)
        self._events.put(None)  # the process closed its stdout: it is ending

    def send(self, cmd: str, **fields: Any) -> None:
        self.process.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict:
        """The peer's next answer, which must be ``event``, within ``timeout`` seconds."""
        try:
            got = self._events.get(timeout=timeout)
        except queue.Empty:
            raise PeerFailed(
                f"peer {self.index} did not say {event!r} within {timeout:.0f}s; see {self.log_path}"
            ) from None
        if got is None:
            raise PeerFailed(
                f"peer {self.index} exited (status {self.process.poll()}) before saying {event!r}:\n{self._log_tail()}"
            )
        if got["event"] != event:
            raise PeerFailed(f"peer {self.index} said {got['event']!r} where {event!r} was expected")
        return got

    def _log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def end_input(self) -> None:
        """Close its stdin: it stops everything and exits."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass

    def stop(self, timeout: float = 60.0) -> None:
        """End its input and wait for it to shut down; kill it if it does not within ``timeout``."""
        self.end_input()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_peers(
    hosts: list, log_dir: Path, timeout: float = 120.0, caps: dict[int, float] | None = None
) -> list[SpartaPeer]:
    """One peer on each of ``hosts`` (tests/netns.py Host), the first the others' DHT bootstrap; ``caps``: the upload
    cap (Mbit/s) of the peers that have one, by index."""
    peers: list[SpartaPeer] = []
    caps = caps or {}
    try:
        first = SpartaPeer(
            hosts[0].namespace, hosts[0].address, 0, len(hosts), [], log_dir / "peer0.log", caps.get(0, 0.0)
        )
        peers.append(first)
        maddrs = first.expect("dht", timeout)["maddrs"]
        for index, host in enumerate(hosts[1:], start=1):
            log = log_dir / f"peer{index}.log"
            peers.append(SpartaPeer(host.namespace, host.address, index, len(hosts), maddrs, log, caps.get(index, 0.0)))
        for peer in peers[1:]:
            peer.expect("dht", timeout)
    except BaseException:
        stop_peers(peers, timeout=10.0)
        raise
    return peers


def stop_peers(peers: list[SpartaPeer], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for peer in peers:  # all of them shut down at once
        peer.end_input()
    for peer in peers:
        peer.stop(max(1.0, deadline - time.monotonic()))


def open_averagers(peers: list[SpartaPeer], prefix: str, values: int, sparta: dict, timeout: float) -> None:
    for peer in peers:
        peer.send("open", prefix=prefix, values=values, sparta=sparta)
    for peer in peers:
        peer.expect("opened", timeout)


def run_round(peers: list[SpartaPeer], round_no: int, timeout: float, with_links: bool = False) -> list:
    """Every peer's RoundReport (as a dict) of round ``round_no``, begun at once on all of them; ``with_links``:
    (report, announced link) pairs."""
    for peer in peers:
        peer.send("round", round=round_no)
    answers = [peer.expect("round", timeout) for peer in peers]
    return [(answer["report"], answer["link"]) if with_links else answer["report"] for answer in answers]


def close_averagers(peers: list[SpartaPeer], timeout: float) -> list[dict]:
    """Stop every peer's averager; their peak RSS so far (MB)."""
    for peer in peers:
        peer.send("close")
    return [peer.expect("closed", timeout)["peak_rss_mb"] for peer in peers]


if __name__ == "__main__":
    sys.exit(main())
