"""This worker's own uplink, probed now and then by sending bytes to a groupmate (engine/uplink_probe.py).

A round cannot show it: the group's slowest sender paces every member, so all of them see about its rate, and
hivemind's load balancing would hand everyone equal shares. After a round, one member of the group (a turn
that moves with the round number) probes the next one, unless it did so less than ``PROBE_EVERY_S`` ago: 1 MiB,
then larger probes until one lasts about a second. The result replaces the rounds' uplink figure (LinkMeter) in
what this worker announces to its next groups: a slow uplink then reduces a smaller share of the parts.
Only the members of this worker's latest group, with their tickets, may probe it (probe_admission.py), and each
whole probe must end within ``PROBE_DEADLINE_S``.
"""

from __future__ import annotations

import time
from typing import Sequence

from hivemind import DHT

from agora_client.averaging.group_admission import GroupAdmission
from agora_client.averaging.link_timing import MARGIN, MIN_RATE, LinkMeter
from agora_client.averaging.probe_admission import GroupProbeAdmission
from agora_client.engine.expert_calls import close_replica, replicate_p2p
from agora_client.engine.uplink_probe import MAX_PROBE_BYTES, ProbeRefused, probe_uplink, serve_uplink_probes
from agora_client.engine.upload_pacing import UploadPacer

PROBE_EVERY_S = 1800.0  # a home uplink changes with the household's use: probe again every half hour
FIRST_PROBE_BYTES = 1 << 20
PROBE_TARGET_S = 1.0  # a probe this long measures the link rather than TCP's slow start
PROBES = 4  # at most, each sized from the rate the one before measured
PROBE_SLACK_S = 5.0  # a probe may take MARGIN x its time at the rate measured before it (the first: MIN_RATE), and this
# a sink's bound on one whole probe, header to answer: above any timeout a prober sets itself (at most MARGIN x
# FIRST_PROBE_BYTES at MIN_RATE + PROBE_SLACK_S, about 13 s; later probes are sized to last about a second)
PROBE_DEADLINE_S = 30.0
# A groupmate lets this worker probe it once its own round has returned, which may be a moment after this one's:
# a refusal is asked again this often, this many times
REFUSED_RETRY_S, REFUSED_RETRIES = 1.0, 3


class UplinkProber:
    """Serves probes to this worker's groupmates and sends its own after rounds (``after_round``), paced by
    ``upload`` (the worker's upload cap) if it has one."""

    def __init__(
        self, dht: DHT, meter: LinkMeter, upload: UploadPacer | None = None, admission: GroupAdmission | None = None
    ):
        self._own, self._meter, self._upload = dht.peer_id.to_base58(), meter, upload
        self.admission = GroupProbeAdmission(self._own, admission)  # who may probe this worker: its latest group
        self._p2p = replicate_p2p(dht)
        serve_uplink_probes(self._p2p, self.admission, PROBE_DEADLINE_S)
        self._last: float | None = None  # when the last probe was sent (time.monotonic)

    def grouped_with(self, peers: Sequence[str]) -> None:
        """Call once a round has averaged with ``peers``, before ``after_round``: they may probe this worker."""
        self.admission.grouped_with(peers)

    def after_round(self, round_no: int, peers: Sequence[str]) -> str | None:
        """After round ``round_no`` with ``peers``: if it is this worker's turn and a probe is due, probe the next
        member (turns go by sorted peer id, the same for every member); what it measured, or why it could not, as a
        line for the worker's log; None otherwise. One member a round: a probe sent while its receiver sends one
        of its own is slowed by the receiver's acknowledgements queueing behind that, on the receiver's uplink."""
        members = sorted(peers)
        if len(members) < 2 or members[round_no % len(members)] != self._own:
            return None
        if self._last is not None and time.monotonic() - self._last < PROBE_EVERY_S:
            return None
        self._last, peer = time.monotonic(), members[(round_no + 1) % len(members)]
        try:
            uplink, size = self._probe(peer)
        except Exception as error:  # ProbeFailed, or a stream closed under it at shutdown: never the round's failure
            return f"could not measure this worker's uplink: {error}; its share of a round's parts follows its rounds"
        self._meter.record_probe(uplink)
        return (
            f"measured this worker's uplink at {uplink * 8 / 1e6:.1f} Mbit/s ({size / 1e6:.1f} MB sent to {peer}): "
            "its share of a round's parts follows it"
        )

    def _probe(self, peer: str) -> tuple[float, int]:
        """(bytes/s, bytes sent) of a probe that lasted PROBE_TARGET_S or was as large as a probe may be: a shorter
        one measures TCP's slow start more than the link, so each next one is sized from the last one's rate."""
        size, uplink, ticket = FIRST_PROBE_BYTES, MIN_RATE, self.admission.own_ticket()
        for _ in range(PROBES):
            timeout = min(PROBE_DEADLINE_S, MARGIN * size / uplink + PROBE_SLACK_S)
            uplink = self._probe_admitted(peer, size, timeout, ticket)
            if size / uplink >= PROBE_TARGET_S or size == MAX_PROBE_BYTES:
                break
            size = int(min(MAX_PROBE_BYTES, max(2 * size, 2 * uplink * PROBE_TARGET_S)))
        return uplink, size

    def _probe_admitted(self, peer: str, size: int, timeout: float, ticket: bytes) -> float:
        for _ in range(REFUSED_RETRIES):
            try:
                return probe_uplink(self._p2p, peer, size, timeout, self._upload, ticket=ticket)
            except ProbeRefused:
                time.sleep(REFUSED_RETRY_S)
        return probe_uplink(self._p2p, peer, size, timeout, self._upload, ticket=ticket)

    def close(self) -> None:
        close_replica(self._p2p)
