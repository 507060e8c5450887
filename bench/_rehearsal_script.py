"""The rehearsal's script of events (bench/rehearsal.py): drawn from --seed, printed before the run, played on time.

Contributors join late, one of them a liar (tests/faulty_worker.py --lie: it answers random tensors of the right
shape and scale), and a points cheat starts with the first (--rotate-run-id: a fresh run id in every metrics
record); both stay to the end. Others leave with Ctrl-C, die by SIGKILL (the client and everything it
started) and rejoin with the same identity, and one pauses and resumes with `agora pause` / `agora resume` from
another terminal (skipped, saying so, where this checkout has no such command). On the operator's side the relay,
the auth service, the monitor and a trainer die by SIGKILL, and `deploy up` starts each again
(bench/_rehearsal_restarts.py). Each event opens a churn window of ``CHURN_S`` seconds, in which the scorecard
counts SPARTA rounds apart.
"""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass

from _rehearsal_homes import REPO, Home

CHURN_S = 60.0
# when each event comes, as a share of the run: late joins first, the leaves once most homes have joined
LATE_JOIN_AT, KILL_AT, REJOIN_AT, PAUSE_AT, RESUME_AT, INTERRUPT_AT = 0.15, 0.4, 0.5, 0.6, 0.7, 0.75
AUTH_CRASH_AT, TRAINER_CRASH_AT = 0.55, 0.85  # the auth crash once most homes have joined
RELAY_CRASH_AT, MONITOR_CRASH_AT = 0.3, 0.65  # the relay's once the relayed homes have joined
LIAR_AT = 0.1  # the liar joins after the homes that start at once: they take the first stages the auth service gives
JITTER = 0.04  # each event (each pair together) moves by up to this share of the run, as the seed draws
OPERATOR_EVENTS = {
    "relay-crash": "the relay",
    "auth-crash": "the auth service",
    "monitor-crash": "the monitor",
    "trainer-crash": "trainer 0",
}


@dataclass(frozen=True)
class Action:
    at_s: float  # seconds after the start
    what: str  # join, interrupt, kill, rejoin, pause, resume; or one of OPERATOR_EVENTS
    home: int | None = None

    def line(self, homes: list[Home]) -> str:
        if self.home is None:
            return (
                f"  t+{self.at_s:6.0f}s  {self.what:13s} SIGKILL to {OPERATOR_EVENTS[self.what]}; deploy up restarts it"
            )
        home = homes[self.home]
        return f"  t+{self.at_s:6.0f}s  {self.what:13s} {home.user} ({home.kind}, {home.link.label})"


def draw(seed: int, homes: int, seconds: float) -> tuple[set[int], list[Action]]:
    """(the homes that start at once, the events in time order), the same for the same seed. Homes 0 to
    ``homes - 1`` are honest; home ``homes``, the liar, joins at ``LIAR_AT`` of the run and home ``homes + 1``, the
    points cheat, at once; both stay to the end."""
    rng = random.Random(seed)
    order = rng.sample(range(homes), homes)
    late, killed, left = order[0], order[1 % homes], order[2 % homes]
    paused = order[3 % homes] if homes > 3 else late

    def at(share: float, shift: float) -> float:
        return (share + shift) * seconds

    kill, pause = rng.uniform(-JITTER, JITTER), rng.uniform(-JITTER, JITTER)  # a pair moves together
    actions = [
        Action(at(LATE_JOIN_AT, rng.uniform(-JITTER, JITTER)), "join", late),
        Action(at(KILL_AT, kill), "kill", killed),
        Action(at(REJOIN_AT, kill), "rejoin", killed),
        Action(at(PAUSE_AT, pause), "pause", paused),
        Action(at(RESUME_AT, pause), "resume", paused),
        Action(at(INTERRUPT_AT, rng.uniform(-JITTER, JITTER)), "interrupt", left),
        Action(at(RELAY_CRASH_AT, rng.uniform(-JITTER, JITTER)), "relay-crash"),
        Action(at(AUTH_CRASH_AT, rng.uniform(-JITTER, JITTER)), "auth-crash"),
        Action(at(MONITOR_CRASH_AT, rng.uniform(-JITTER, JITTER)), "monitor-crash"),
        Action(at(TRAINER_CRASH_AT, rng.uniform(-JITTER, JITTER)), "trainer-crash"),
        Action(at(LIAR_AT, 0.0), "join", homes),
    ]
    return set(range(homes)) - {late} | {homes + 1}, sorted(actions, key=lambda action: action.at_s)


def control(home: Home, command: str) -> str:
    """`agora pause` or `agora resume` for the home's client, from another terminal of the same home."""
    with home.net.home.entered():
        result = subprocess.run(
            [sys.executable, str(REPO / "agora_cli.py"), command, "--config-dir", str(home.config_dir), "--cpu"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    return f"exit {result.returncode}: {(result.stdout + result.stderr).strip()}"


def play(action: Action, homes: list[Home], start_home, operator_events: dict) -> str:
    """Do ``action``; what happened, in one line. ``start_home(home)`` starts a home's client; ``operator_events``
    maps each of OPERATOR_EVENTS to a function that plays it and says what happened."""
    if action.home is None:
        return operator_events[action.what]()
    home = homes[action.home]
    if action.what in ("join", "rejoin"):
        start_home(home)
        return f"{home.user} started (start {len(home.runs)})"
    if action.what == "kill":
        removed = home.kill()
        return f"{home.user} killed with SIGKILL (its {removed} /dev/shm files went with it, as a reboot clears them)"
    if action.what == "interrupt":
        home.interrupt()
        code = home.runs[-1].proc.returncode if home.runs else None
        return f"{home.user} stopped with Ctrl-C (exit {code})"
    return f"agora {action.what} for {home.user}: {control(home, action.what)}"
