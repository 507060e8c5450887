"""Who may send this worker an uplink probe (engine/uplink_probe.py): the members of its latest averaging group,
each holding a ticket for this stage (group_admission.py), and who this worker is when it sends one itself.

A sink reads up to a probe's size from whoever it admits, so a stranger must not get that far: a peer outside the
latest group is refused before the sink reads anything from it, and a member's ticket is checked as a groupmate's
is at matchmaking. A worker probes a member of the group it just averaged with (averaging/uplink.py), so honest
probes always come from there.
"""

from __future__ import annotations

from collections.abc import Iterable

from agora_client.averaging.group_admission import GroupAdmission

PROBE_CONTEXT = "uplink probe"


class GroupProbeAdmission:
    """The engine's ProbeAdmission for a worker: its latest group's members, with tickets when ``admission`` is on."""

    def __init__(self, own_peer_id: str, admission: GroupAdmission | None):
        self._own, self._admission = own_peer_id, admission
        self._members: frozenset[str] = frozenset()  # replaced whole by the round thread, read by the p2p loop

    def grouped_with(self, peers: Iterable[str]) -> None:
        """This worker's latest group averaged with ``peers``: from now on they, and only they, may probe it."""
        self._members = frozenset(peers) - {self._own}

    def own_ticket(self) -> bytes:
        """The ticket this worker presents with its own probes (empty when tickets are off)."""
        return b"" if self._admission is None else self._admission.credentials(self._own)["ticket"].encode("ascii")

    def caller_refusal(self, peer: str) -> str | None:
        if peer in self._members:
            return None
        reason = "only members of this worker's latest averaging group may probe its uplink"
        if self._admission is not None:
            self._admission.rejections.report(peer, "not_in_group", f"{PROBE_CONTEXT}: {reason}")
        return reason

    def ticket_refusal(self, peer: str, ticket: bytes) -> str | None:
        if self._admission is None:
            return None
        return self._admission.refusal(peer, {"ticket": ticket.decode("ascii", "replace")}, PROBE_CONTEXT)
