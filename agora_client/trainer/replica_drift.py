"""The stages' replica drift beside the spot checks' tolerances in the trainer's report.

The figure is the one the app's swarm view shows (agora_client/discovery/replica_drift.py): how far a stage's
workers' parameters are from their groups' averages, from their metrics records as the monitor verifies them,
which takes the auth service's public key. A tolerance says how far honest answers drift apart; this says how far
the parameters behind them do. Spot checks do not judge by it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hivemind import DHT

from agora_client.auth.client import swarm_status
from agora_client.auth.ticket_source import SelfIssuedTickets, TicketSource
from agora_client.monitor.records import fetch_replica_drifts

Say = Callable[[str, str], None]


def auth_public_key(tickets: TicketSource | None, auth_url: str | None, say: Say) -> str | None:
    """The key that verifies the workers' tickets: the one this trainer signs its own tickets with, else the auth
    service's (its /v1/status says it); None when neither is at hand (said, when the service did not answer)."""
    if isinstance(tickets, SelfIssuedTickets):
        return tickets.public_key
    if not auth_url:
        return None
    try:
        return str(swarm_status(auth_url)["public_key"])
    except Exception as error:  # unreachable, or a bad answer (the client raises a private error for it)
        say(
            "WARNING",
            f"could not read the auth service's public key from {auth_url} ({error}): other trainers' verdicts "
            "on caught workers are not read, and the spot-check report shows no parameter drift",
        )
        return None


class ReplicaDrifts:
    """Reads each stage's replica drift from the DHT when asked; {} without the key or on a DHT hiccup."""

    def __init__(self, dht: DHT, stages: Sequence[str], auth_public_key: str | None, say: Say):
        self.dht, self.stages, self.auth_public_key, self.say = dht, tuple(stages), auth_public_key, say

    def read(self) -> dict[str, float | None]:
        if self.auth_public_key is None:
            return {}
        try:
            return fetch_replica_drifts(self.dht, self.stages, self.auth_public_key)
        except Exception as error:  # a DHT hiccup must not stop training; the next report reads again
            self.say("WARNING", f"could not read the workers' metrics records: {error}")
            return {}
