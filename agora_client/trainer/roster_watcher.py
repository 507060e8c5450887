"""The trainer's view of every stage's workers, kept current from the stage DHTs.

Workers that any ticketed trainer's spot checks caught lying (a verified verdict in the DHT,
agora_client/monitor/verdicts.py) are left out of it: a trainer started after the verdict, a second trainer, or this
one restarted would otherwise route to the liar again, and train on its answers, until its own checks caught it anew.
The caught peers stay out for this trainer's lifetime, also after their verdicts expire in the DHT.
"""

from __future__ import annotations

import threading

from hivemind import DHT

from agora_client.discovery.roster import WorkerRecord, fetch_roster
from agora_client.monitor.verdicts import fetch_verdicts
from agora_client.trainer.balancer import Router
from agora_client.trainer.replica_drift import Say


class RosterWatcher(threading.Thread):
    """Keeps the router's view of every stage current from the stage DHTs, without the workers caught lying.

    ``auth_public_key`` verifies the verdicts' trainer tickets; None: no verdict is read."""

    MISSES_TO_FORGET = 2  # a loaded DHT sometimes answers one read empty: that alone must not drop live workers

    def __init__(
        self,
        dhts: dict[str, DHT],
        router: Router,
        period: float,
        stop: threading.Event,
        say: Say,
        auth_public_key: str | None,
    ):
        super().__init__(name="roster", daemon=True)
        self.dhts, self.router, self.period, self.stop, self.say = dhts, router, period, stop, say
        self.auth_public_key = auth_public_key
        self.known: dict[str, set[str]] = {stage: set() for stage in dhts}
        self.listed: dict[str, dict[str, tuple[WorkerRecord, int]]] = {
            stage: {} for stage in dhts
        }  # peer -> (record, misses)
        self.caught: set[str] = set()  # peer ids

    def refresh(self) -> None:
        self._read_verdicts()
        for stage, dht in self.dhts.items():
            try:
                fetched = fetch_roster(dht, stage)
            except Exception as error:  # a DHT hiccup must not stop routing on the last known roster
                self.say("WARNING", f"could not read the {stage} roster: {error}")
                continue
            listed = self.listed[stage]
            for peer_id in [peer_id for peer_id in listed if peer_id not in fetched]:
                record, misses = listed[peer_id]
                if misses + 1 >= self.MISSES_TO_FORGET:
                    del listed[peer_id]
                else:
                    listed[peer_id] = (record, misses + 1)
            listed.update((peer_id, (record, 0)) for peer_id, record in fetched.items())
            records = [record for record, _ in listed.values() if record.peer_id not in self.caught]
            self.router[stage].update_roster(records)
            self._say_changes(stage, {record.uid for record in records})

    def _read_verdicts(self) -> None:
        if self.auth_public_key is None:
            return
        try:
            verdicts = fetch_verdicts(next(iter(self.dhts.values())), self.auth_public_key)
        except Exception as error:  # the peers caught so far stay out; the next refresh reads again
            self.say("WARNING", f"could not read the trainers' verdicts: {error}")
            return
        for verdict in verdicts:
            if verdict.peer_id not in self.caught:
                self.caught.add(verdict.peer_id)
                self.say(
                    "ROSTER",
                    f"keeping {verdict.uid} (peer {verdict.peer_id}) out of routing: trainer {verdict.trainer}'s "
                    f"spot checks caught it ({verdict.disagreements} disagreements in {verdict.checks} checks)",
                )

    def _say_changes(self, stage: str, uids: set[str]) -> None:
        joined, gone = sorted(uids - self.known[stage]), sorted(self.known[stage] - uids)
        if joined or gone:
            changes = " ".join([*(f"+{uid}" for uid in joined), *(f"-{uid}" for uid in gone)])
            self.say("ROSTER", f"{stage}: {changes} ({len(uids)} workers)")
        self.known[stage] = uids

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.refresh()
