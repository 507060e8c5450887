"""The rehearsal's contributors (bench/rehearsal.py): in each home the real client, as a volunteer starts it,

    python3 agora_cli.py --headless --log-format json --cpu --swarm https://11.77.0.1:8440 --ca-cert ca.pem

with its own config dir (its identity key, its JSONL event log) and its token in HF_TOKEN. Its headless JSON lines
go to ``<run>/homes/<user>-<n>.log`` (n counts its starts: a rejoin is a second start with the same identity).
What a home did is read back from those lines and from the client's own event log (``<config dir>/logs``), which
keeps the kinds the headless printer leaves out or throttles (traffic, resources, every step). The liar and the
cheat run the runtime itself with their faults injected (tests/faulty_worker.py --lie, --rotate-run-id), as a
modified client would.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from _rehearsal_leftovers import shm_files_of
from _rehearsal_net import HomeLink, HubRouter, PublicHome

from agora_client.events import json_objects
from agora_client.swarm.processes import ManagedProcess
from tests.faulty_worker import Faults, faulty

REPO = Path(__file__).resolve().parents[1]
RETRY_EVERY_S = 10.0  # a home the swarm could not reach asks again this often
STOP_GRACE_S = 30.0


@dataclass
class Home:
    index: int
    user: str
    net: HubRouter | PublicHome
    link: HomeLink
    root: Path  # <run>/homes
    faults: Faults | None = None  # a dishonest home: the runtime run by tests/faulty_worker.py with these faults
    runs: list[ManagedProcess] = field(default_factory=list)
    started_at: list[float] = field(default_factory=list)  # wall-clock time of each start

    @property
    def kind(self) -> str:
        return self.net.kind

    @property
    def config_dir(self) -> Path:
        return self.root / self.user

    @property
    def alive(self) -> bool:
        return bool(self.runs) and self.runs[-1].alive

    def start(self, auth_url: str, ca_cert: Path, token: str) -> None:
        """Start the client in the home (again, with the same identity, if it ran before); a dishonest home runs the
        runtime itself, as the headless client runs it, with its faults injected."""
        args = ["--cpu", "--swarm", auth_url, "--ca-cert", str(ca_cert), "--config-dir", str(self.config_dir)]
        args += ["--host-port", "0", "--retry-every", str(RETRY_EVERY_S)]
        if self.faults is not None:
            args, program = ["runtime", *args], [*faulty(), *self.faults.flags()]
        else:
            args, program = ["--headless", "--log-format", "json", *args], [sys.executable, str(REPO / "agora_cli.py")]
        with self.net.home.entered():
            self.started_at.append(time.time())
            self.runs.append(
                ManagedProcess(
                    self.user,
                    args,
                    self.root / f"{self.user}-{len(self.runs) + 1}.log",
                    env={"HF_TOKEN": token},
                    program=program,
                )
            )

    def interrupt(self) -> None:
        """Ctrl-C: the client stops its worker, gives its slot back and exits."""
        if self.alive:
            self.runs[-1].stop(grace=STOP_GRACE_S)

    def kill(self) -> int:
        """SIGKILL to everything the home runs (the client, its runtime in a session of its own, the p2p daemon): a
        machine that died. The home's namespace holds only this home's processes. Its /dev/shm goes with it, as a
        reboot clears it: the shared-memory files torch named after those processes are removed; how many."""
        pids = set(self.net.home.pids())
        self.net.home.kill_all()
        if self.runs:
            self.runs[-1].stop(grace=5)
        files = shm_files_of(pids)
        for name in files:
            Path("/dev/shm", name).unlink(missing_ok=True)
        return len(files)

    def stop(self) -> None:
        for run in self.runs:
            run.stop(grace=STOP_GRACE_S)

    def headless(self) -> list[dict]:
        """Every headless JSON line of every start, in order (other lines, e.g. stderr, left out)."""
        records = []
        for run in self.runs:
            for line in run.lines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and "tag" in record:
                    records.append(record)
        return records

    def events(self) -> list[dict]:
        """Every event of the client's own JSONL log (all its starts, rotated files oldest first); a dishonest
        home's runtime has no client to keep that log: its events are its output."""
        if self.faults is not None:
            return [event for run in self.runs for event in json_objects(run.lines())]
        logs = self.config_dir / "logs"
        events = []
        for path in sorted(logs.glob("*.jsonl")):  # rotated files too; sorted by time below
            events += json_objects(path.read_text(encoding="utf-8", errors="replace").splitlines())
        return sorted(events, key=lambda event: event["ts"])
