"""SPARTA: sparse parameter averaging between the workers of one stage.

Every round, the workers of a stage that are due find each other through hivemind matchmaking
over the DHT and average one rotating slice of their parameters (see partition.py) with hivemind's
butterfly all-reduce, in float32 or compressed (sparta.payload; compression.py, with error feedback). A round
is timed by its group's slowest link and the bytes its payload puts on the wire; every worker measures its
link on its own rounds and announces it when it joins one (link_timing.py); its uplink, probed now and then by
sending bytes to a groupmate (uplink.py), sizes its share of the parts to reduce, and a worker says once if
rounds cannot fit between two rounds at its measured link.
Training keeps stepping while a round is in flight, so the result is applied as a delta:
param_slice += averaged - sent, where a compressed payload's average leaves out what compression dropped
from this peer's part (the next round over the slice sends it). Optimizer moments stay local. With an outer
step (sparta.outer_momentum / outer_lr, outer_momentum.py) the slice moves to the step's target instead of the
average, again as a delta: param_slice += target - sent.
Every round that averaged reports its drift: how far this worker's slice was from the group's average
before the update, and is right after it (drift.py); with an outer step, "after" is still measured against the
group's average, not against the step's target.

Matchmaking: every round has its own group key, so workers on different rounds never meet. The first
worker of the stage to reach a round leads it and waits up to ``2 x matchmaking_time`` for the others
(their epoch boundaries arrive at slightly different moments), and never past half the time between
two rounds; the group is assembled as soon as every worker the stage counts (its roster, the worker node says)
has joined. A round still looking for its group when the next one is due gives way to it, so one missed round never
makes the next one miss as well; a round due while the previous one is still averaging waits for it (another slice:
the two never touch the same parameters).

Each peer's influence is bounded (bounds.py): reducers bound every sender's part, senders bound every
averaged part that comes back; the peers that had to be bounded are named in the round's report.
With tickets on (group_admission.py), only workers of this stage holding the auth service's ticket are
let into a group; a group with anyone else in it is refused, and the round's report names them.

Threads and processes:
- the caller (the training loop) calls begin_round; it holds `lock` only while copying the slice out;
- one background thread ("sparta-round") waits for hivemind, then holds `lock` while adding the delta,
  and calls on_round(report);
- hivemind's averager runs in its own process and exchanges a shared float32 CPU buffer.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from agora_client.averaging.bounds import bounded, bounded_weight
from agora_client.averaging.compression import SlicePayload
from agora_client.averaging.drift import SliceDrift, relative_l2
from agora_client.averaging.group_admission import GroupAdmission
from agora_client.averaging.link_timing import MIN_RATE, LinkMeter, LinkRates, butterfly_bytes, round_timing
from agora_client.averaging.outer_momentum import OuterMomentum
from agora_client.averaging.partition import StridedPartition, partition_of
from agora_client.averaging.uplink import UplinkProber
from agora_client.config import SpartaConfig
from agora_client.engine.averaging import GroupTimeouts, RoundAverager, RoundOutcome, found_no_group
from agora_client.events import SpartaEvent
from agora_client.upload_cap import UploadCap


@dataclass(frozen=True)
class RoundReport:
    """What one SPARTA round did, as seen by this worker."""

    round: int
    partition: int
    group_size: int  # peers matched for the round, this worker included; 0 if no group formed
    fraction: float  # share of this worker's slice that came back averaged with at least one other peer
    bytes_sent: int  # serialized averaging messages (protobuf bytes), without libp2p framing and encryption
    bytes_received: int
    duration_s: float
    weight: float
    ok: bool
    reason: str | None = None
    suspects: tuple[tuple[str, str], ...] = ()  # (peer id, what it sent) for every peer whose numbers were bounded
    allreduce_s: float = 0.0  # the all-reduce alone, matchmaking excluded
    notice: str | None = None  # said once: rounds of this size cannot fit between two rounds at the measured link
    uplink: str | None = None  # what this worker's uplink probe measured after the round, or why it could not
    # relative L2 of this worker's slice from the group's average, before and after the update (drift.py); None:
    # no average came back, or it was not a number
    drift_before: float | None = None
    drift_after: float | None = None

    def to_event(self, layout: StridedPartition) -> SpartaEvent:
        """The round as an event.

        ``layout`` (the averager's ``partition``) says what share of the stage its slice is."""
        return SpartaEvent(
            round=self.round,
            partition=self.partition,
            group_size=self.group_size,
            fraction=self.fraction,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            duration_s=self.duration_s,
            weight=self.weight,
            ok=self.ok,
            reason=self.reason,
            partitions=layout.num_partitions,
            stage_share=layout.slice_size(self.partition) / layout.total if layout.total else None,
            drift_before=self.drift_before,
            drift_after=self.drift_after,
        )


class _BoundingScreen:
    """SPARTA's PartScreen: every groupmate's numbers are bounded against this peer's own (bounds.py), as a
    sender's part here and as an averaged part a remote reducer returns; the peers bounded are named."""

    def __init__(self, max_ratio: float):
        self._max_ratio = max_ratio
        self.suspects: dict[str, str] = {}  # peer id -> what it sent or returned
        self._discarded = 0

    def sent_part(
        self, sender: PeerID, own: torch.Tensor, part: torch.Tensor, weight: float
    ) -> tuple[torch.Tensor, float]:
        weight = bounded_weight(weight)
        part, problem = bounded(own, part, self._max_ratio)
        if problem is not None:
            self._suspect(sender, f"sent {problem}")
            if problem.startswith(("non-finite", "a part of shape")):
                weight = 0.0  # nothing of it enters the average
        return part, weight

    def returned_part(self, reducer: PeerID, own: torch.Tensor, delta: torch.Tensor) -> None:
        value, problem = bounded(own, own + delta, self._max_ratio)
        if problem is not None:
            self._suspect(reducer, f"returned {problem}")
            if problem.startswith("non-finite"):
                self._discarded += delta.numel()
            delta.copy_(value - own)

    def discarded(self) -> int:
        return self._discarded

    def _suspect(self, peer: PeerID, problem: str) -> None:
        self.suspects.setdefault(peer.to_base58(), problem)


class _GroupAverager(RoundAverager):
    """The engine's round averager with SPARTA's group rules: tickets (admission), a positive weight, bounds."""

    def __init__(
        self,
        buffer: torch.Tensor,
        dht: DHT,
        *,
        layout: bytes,
        config: SpartaConfig,
        admission: GroupAdmission | None,
        payload: SlicePayload,
        **kwargs: Any,
    ):
        super().__init__(
            buffer,
            dht,
            layout=layout,
            compression=payload.compression,
            part_size_bytes=payload.part_size_bytes,
            **kwargs,
        )
        self._admission, self._sparta = admission, config  # not _config: multiprocessing.Process has one
        self._payload_bytes = buffer.numel() * payload.bytes_per_value  # what a round moves, each way, per value
        self._largest_message = payload.largest_message_bytes

    def joiner_refusal(self, peer: PeerID, data: Any) -> str | None:
        # as a leader: a peer without a ticket for this stage never gets into our group
        return None if self._admission is None else self._admission.refusal(peer.to_base58(), data)

    def group_refusal(self, peer_ids: Sequence[PeerID], members: Sequence[Any]) -> str | None:
        for peer, data in zip(peer_ids, members, strict=True):
            refusal = None if peer == self.peer_id else self.joiner_refusal(peer, data)
            if refusal is not None:
                return f"refused: peer {peer.to_base58()} may not average with this stage ({refusal})"
        weights = [member.get("weight") if isinstance(member, dict) else None for member in members]
        if not any(isinstance(weight, (int, float)) and weight > 0 for weight in weights):  # malformed: weight 0
            return "every worker in the group had weight 0"
        return None

    def new_screen(self) -> _BoundingScreen:
        return _BoundingScreen(self._sparta.max_peer_delta)

    def group_timeouts(self, members: Sequence[Any]) -> GroupTimeouts:
        # timed by the slowest link any member announced (clamped: a peer cannot make its group wait for ever)
        announced = [
            LinkRates.announced(member.get("link")) if isinstance(member, dict) else None for member in members
        ]
        slowest = min((rates.slowest for rates in announced if rates is not None), default=MIN_RATE)
        timing = round_timing(self._payload_bytes, len(members), slowest, self._largest_message, self._sparta)
        return GroupTimeouts(timing.allreduce_timeout, timing.sender_timeout, timing.reducer_timeout)


@dataclass
class _Flight:
    """One round begun by begin_round, as the caller's and the round's threads both see it."""

    round_no: int
    begun_at: float  # monotonic time it was begun: when its peers, on time, began it too
    gather_window: float  # seconds a leader waits for the whole stage to join
    interval_s: float | None = None  # seconds since the previous round began (None: the first round)
    future: Future[RoundReport] | None = None
    control: StepControl | None = None  # hivemind's step, once it has been asked for
    stop_reason: str | None = None  # why it was called off: a newer round was due before it averaged, or shutdown


class SpartaAverager:
    """Averages one rotating slice of a stage's parameters with the other workers of the stage.

    :param dht: a running hivemind DHT of this worker
    :param prefix: DHT/matchmaking namespace shared by the workers of one stage, without '.' (e.g. "run_body1_sparta")
    :param parameters: the stage's trainable parameters, in the same order on every worker
    :param lock: the lock the training loop holds while it changes the parameters (optimizer.step, loading state);
      SPARTA holds it only to copy the slice out (begin_round) and to add the delta (round thread)
    :param on_round: called with each RoundReport from the round thread ("sparta-round"), or from the caller's
      thread for a round skipped because the previous one is still in flight; it must not block for long
    :param stage_size: how many workers the stage has now (this one included), asked from the round thread
      at the start of every round: the group is assembled as soon as that many have joined
    :param admission: the ticket check for groupmates and this worker's own ticket (None: anyone may average)
    :param upload: the worker's upload cap: every part and probe sent waits for it, and the uplink this worker
      announces (its share of the parts, its group's time bounds) is never more than it
    """

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        parameters: Sequence[torch.nn.Parameter],
        config: SpartaConfig,
        *,
        lock: AbstractContextManager,
        on_round: Callable[[RoundReport], None] | None = None,
        stage_size: Callable[[], int] | None = None,
        admission: GroupAdmission | None = None,
        upload: UploadCap | None = None,
        start: bool = True,
    ):
        if not prefix or "." in prefix:
            raise ValueError(f"SPARTA prefix must be a non-empty name without '.', got {prefix!r}")
        self._parameters = list(parameters)
        self.partition = StridedPartition.of(self._parameters, config.num_partitions)
        self._lock, self._on_round, self._stage_size = lock, on_round, stage_size
        # the leader waits up to this long for the stage's other workers, whose epochs end a little later than its own
        self._max_gather_window = 2 * config.matchmaking_time
        self._last_begin: float | None = None  # when the previous round began (time.monotonic)
        self._find_group_timeout = 3 * config.matchmaking_time
        self._group_needs = config.matchmaking_time + self._max_gather_window  # hivemind's minimum, then the gathering
        self._buffer = torch.zeros(self.partition.max_slice_size, dtype=torch.float32)
        self._config, self._payload = config, SlicePayload(config.payload, self._buffer)
        self._outer = OuterMomentum(config.outer_momentum, config.outer_lr) if config.outer_step else None
        assumed = config.assumed_link_mbps * 1e6 / 8
        self._link = LinkMeter(LinkRates(assumed, assumed), max_up=None if upload is None else upload.bytes_per_s)
        self._upload = upload
        self._fit_said = False
        # the group bounds its all-reduce by its slowest link (group_timeouts); this one only backs that up
        slowest_round = round_timing(
            self._round_bytes, LARGEST_GROUP, MIN_RATE, self._payload.largest_message_bytes, config
        ).allreduce_timeout
        self._round_timeout = self._find_group_timeout + slowest_round + config.matchmaking_time
        self._averager = self._new_averager(dht, prefix, config, admission, upload)
        self._dht, self._admission, self._uplink = dht, admission, None  # the prober, once started
        self._credentials = (
            (lambda: {}) if admission is None else (lambda: admission.credentials(dht.peer_id.to_base58()))
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparta-round")
        self._begin_lock = threading.Lock()
        self._flight = _Flight(-1, 0.0, 0.0)  # the latest round begun
        self._closed = False  # shut down: rounds asked for later are skipped
        if start:
            self.start()

    def _new_averager(
        self, dht: DHT, prefix: str, config: SpartaConfig, admission: GroupAdmission | None, upload: UploadCap | None
    ) -> _GroupAverager:
        return _GroupAverager(
            self._buffer,
            dht,
            upload=upload,
            # peers on another payload cut the slice into other parts: they must never be grouped with this one
            layout=self.partition.fingerprint + config.payload.encode(),
            config=config,
            admission=admission,
            payload=self._payload,
            prefix=prefix,
            min_group_size=2,
            min_matchmaking_time=config.matchmaking_time,
            request_timeout=config.matchmaking_time / 2,
            allreduce_timeout=None,  # set per group, from its members' links (group_timeouts)
            sender_timeout=config.sender_timeout,
            # a reducer first waits up to sender_timeout for its slowest sender, then gets its own reducer_timeout
            reducer_timeout=config.sender_timeout + config.reducer_timeout,
            allow_state_sharing=False,
        )

    @property
    def _round_bytes(self) -> float:
        """What one round's slice weighs on the wire, each way (before the butterfly's 2(n-1)/n)."""
        return self._buffer.numel() * self._payload.bytes_per_value

    def parameters_replaced(self) -> None:
        """Call after loading the parameters wholesale (a snapshot): what compression dropped from the old values
        is then forgotten instead of being sent with the new ones, and so are the outer step's anchors. Any thread."""
        self._payload.parameters_replaced()
        if self._outer is not None:
            self._outer.parameters_replaced()

    def start(self) -> None:
        self._averager.run_in_background(await_ready=True)
        self._uplink = UplinkProber(self._dht, self._link, self._upload, admission=self._admission)

    @property
    def announced_link(self) -> LinkRates:
        """The rates this worker announces to its next group (its uplink never above its upload cap)."""
        return self._link.rates

    @property
    def in_flight(self) -> bool:
        return self._flight.future is not None and not self._flight.future.done()

    def begin_round(self, round_no: int, weight: float) -> Future[RoundReport]:
        """Start averaging slice round_no mod P with weight (0 = receive only); returns at once."""
        if round_no < 0:
            raise ValueError(f"round number must be >= 0, got {round_no}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"SPARTA weight must be a finite number >= 0, got {weight}")
        started, part = time.monotonic(), partition_of(round_no, self.partition.num_partitions)
        with self._begin_lock:
            if self._closed:
                return self._skipped(round_no, part, weight, "skipped: the averager is shutting down")
            # a full-parameter round (one slice) cannot wait behind the previous one: that one averages the same slice
            if self.in_flight and not self._supersede(round_no) and self.partition.num_partitions == 1:
                return self._skipped(round_no, part, weight, "skipped: the previous round is still averaging")
            sent = torch.empty(self.partition.slice_size(part), dtype=torch.float32)
            with self._lock:
                self.partition.gather(self._parameters, part, sent)
            interval = None if self._last_begin is None else started - self._last_begin
            self._flight = flight = _Flight(round_no, started, self._gather_window(interval), interval)
            self._last_begin = started
            flight.future = self._executor.submit(self._run_round, flight, round_no, part, float(weight), sent, started)
            return flight.future

    def _skipped(self, round_no: int, part: int, weight: float, reason: str) -> Future[RoundReport]:
        done: Future[RoundReport] = Future()
        done.set_result(
            self._publish(RoundReport(round_no, part, 0, 0.0, 0, 0, 0.0, float(weight), ok=False, reason=reason))
        )
        return done

    def _gather_window(self, interval: float | None) -> float:
        """How long a leader waits for a full group: never past half the time between two rounds, so that a
        peer that died (still counted in the stage until its record expires) cannot make the round overrun."""
        return self._max_gather_window if interval is None else min(self._max_gather_window, max(0.5, interval / 2))

    def _supersede(self, round_no: int) -> bool:
        """Call off the latest round if it has not found its group in the time a group needs since it was begun
        (its peers, who began it then, have moved on too): time it waited behind the round before it counts, or
        a worker one round behind its stage would start every round too late to meet its peers, and fail each
        one after the full search. A younger one keeps matchmaking and the new round waits behind it: when rounds
        come faster than groups form, giving way every time would leave no round to finish."""
        flight = self._flight
        young = flight.control is not None and time.monotonic() - flight.begun_at < self._group_needs
        if young and not flight.control.done():
            return False
        return self._call_off(flight, f"gave way to round {round_no}: no group formed before it was due")

    @staticmethod
    def _call_off(flight: _Flight, reason: str) -> bool:
        """Stop a round that is waiting for its turn or still matchmaking; False if it is averaging already."""
        control = flight.control
        if control is not None and (control.done() or control.stage != AveragingStage.LOOKING_FOR_GROUP):
            return False
        flight.stop_reason = reason
        if control is not None:  # else the round stops itself before, or as soon as, it has its control
            cancel_step(control)
        return True

    def _run_round(
        self, flight: _Flight, round_no: int, part: int, weight: float, sent: torch.Tensor, started: float
    ) -> RoundReport:
        outgoing = self._payload.outgoing(part, sent)
        self._averager.reset_traffic()
        group_size, fraction, suspects, allreduce_s, drift = 0, 0.0, {}, 0.0, SliceDrift(None, None)
        try:
            outcome = self._match_and_average(flight, round_no, weight, outgoing)
        except Exception as error:
            reason = self._why_called_off(flight) or _describe_failure(error, self._find_group_timeout)
        else:
            group_size, reason, allreduce_s = outcome.group_size, outcome.skipped, outcome.allreduce_s
            suspects = outcome.screen.suspects if outcome.screen is not None else {}
            if reason is None and self._uplink is not None:  # every member passed the group's ticket checks
                self._uplink.grouped_with(outcome.peers)
            if reason is None:
                fraction, reason, drift = self._apply_average(part, sent, outgoing, outcome)
        bytes_sent, bytes_received = self._averager.traffic_bytes()
        probed = None
        if reason is None:  # a whole round measures the link; a partial one was cut short by someone's failure
            self._link.record(bytes_sent, bytes_received, allreduce_s)
            probed = self._uplink.after_round(round_no, outcome.peers) if self._uplink is not None else None
        return self._publish(
            RoundReport(
                round=round_no,
                partition=part,
                group_size=group_size,
                fraction=fraction,
                bytes_sent=bytes_sent,
                bytes_received=bytes_received,
                duration_s=time.monotonic() - started,
                weight=weight,
                ok=group_size > 0 and fraction > 0,
                reason=reason,
                suspects=tuple(sorted(suspects.items())),
                allreduce_s=allreduce_s,
                notice=self._fit_notice(flight.interval_s, group_size),
                uplink=probed,
                drift_before=drift.before,
                drift_after=drift.after,
            )
        )

    def _fit_notice(self, interval_s: float | None, group_size: int) -> str | None:
        """Once per run: rounds of this slice take longer, at the measured link, than the time between two rounds."""
        if self._fit_said or interval_s is None or group_size < 2:
            return None
        rates = self._link.rates
        timing = round_timing(
            self._round_bytes, group_size, rates.slowest, self._payload.largest_message_bytes, self._config
        )
        if timing.expected_s <= interval_s:
            return None
        self._fit_said = True
        moved = butterfly_bytes(self._round_bytes, group_size)
        return (
            f"a round moves {moved / 1e6:.0f} MB each way per peer; at this worker's measured link "
            f"({rates.up * 8 / 1e6:.0f} Mbit/s up, {rates.down * 8 / 1e6:.0f} down) it takes "
            f"~{timing.expected_s:.0f}s, but rounds start every {interval_s:.0f}s: rounds will be skipped while "
            "one is in flight; "
            "a faster link, a larger sparta.period or a smaller sparta.fraction makes them fit"
        )

    def _match_and_average(self, flight: _Flight, round_no: int, weight: float, outgoing: torch.Tensor) -> RoundOutcome:
        if self._why_called_off(flight):  # called off while it waited behind the previous round
            raise CancelledError()
        # the previous round's all-reduce may still hold the buffer in hivemind's process, for good if it is stopped
        with self._averager.tensors_unless(lambda: self._why_called_off(flight) is not None, STOP_POLL_S) as (buffer,):
            buffer.zero_()
            buffer[: outgoing.numel()].copy_(outgoing)
        stage_size = self._stage_size() if self._stage_size is not None else 0
        # one matchmaking key per round: workers on another round never land in this group
        self._averager.set_round(format(round_no, "b"), stage_size if stage_size >= 2 else None).result(
            timeout=self._find_group_timeout
        )
        rates = self._link.rates
        self._averager.announce_bandwidth(rates.up)  # a slow uplink gets a smaller share of the parts to reduce
        return self._run_step(flight, {"weight": weight, "link": rates.to_json(), **self._credentials()}, weight)

    def _apply_average(
        self, part: int, sent: torch.Tensor, outgoing: torch.Tensor, outcome: RoundOutcome
    ) -> tuple[float, str | None, SliceDrift]:
        """Add (averaged - sent) to the slice, or (target - sent) with an outer step; returns the share of it averaged
        with another peer, why not all, and the slice's drift from the group's average (after the update too, even
        with an outer step). ``outgoing``: ``sent`` plus the residual of a lossy payload."""
        size, unshared = sent.numel(), outcome.unshared
        with self._averager.get_tensors() as (buffer,):
            delta = self._payload.averaged(part, outgoing, buffer[:size], outcome.local_parts) - sent
        broken = ~torch.isfinite(delta)  # a part whose only surviving senders had weight 0 divides by zero
        delta[broken] = 0.0
        average, applied = sent + delta, torch.empty_like(sent)
        averaged = size - min(size, unshared + int(broken.sum()))
        # the engine counts the elements a partial round left out but does not say which: such a round averages
        # plainly and leaves the anchors and momenta as they were, for the next whole round to step from
        if self._outer is not None and averaged == size:
            delta = self._outer.delta(part, sent, average)
        with self._lock:
            self.partition.add_(self._parameters, part, delta)
            self.partition.gather(self._parameters, part, applied)
        drift = SliceDrift(relative_l2(sent, average), relative_l2(applied, average))
        if averaged < size:
            kept = f"{size - averaged} of {size} elements kept their local values: a peer dropped out"
            return averaged / size, kept, drift
        return 1.0, None, drift

    def _run_step(self, flight: _Flight, gather: dict, weight: float) -> RoundOutcome:
        """Matchmaking and all-reduce in hivemind's process."""
        control = self._averager.begin_step(
            gather=gather,
            weight=weight,
            scheduled_time=get_dht_time() + flight.gather_window,
            timeout=self._find_group_timeout,
            allow_retries=False,
        )
        flight.control = control
        if self._why_called_off(flight):  # called off before it had a control to cancel
            cancel_step(control)
        deadline = time.monotonic() + self._round_timeout
        while True:  # in slices: a step hivemind's process had begun stays unresolved once that process is stopped
            try:
                return control.result(timeout=min(STOP_POLL_S, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if self._why_called_off(flight):
                    raise CancelledError() from None
                if time.monotonic() >= deadline:
                    cancel_step(control)
                    raise

    def _why_called_off(self, flight: _Flight) -> str | None:
        """Why a round was called off (None while it goes on): it gave way to a later one, or the averager stops
        (which reaches the rounds still queued behind the latest, too)."""
        return flight.stop_reason or (SHUTTING_DOWN if self._closed else None)

    def _publish(self, report: RoundReport) -> RoundReport:
        if self._on_round is not None:
            self._on_round(report)
        return report

    def shutdown(self) -> None:
        """Leave at once, even mid all-reduce: cancel the round in flight, stop hivemind's process (which aborts
        its all-reduce: the groupmates finish without this peer's parts), then wait for the round thread."""
        with self._begin_lock:
            if self._closed:
                return
            self._closed = True
            flight = self._flight
        flight.stop_reason = SHUTTING_DOWN
        if flight.control is not None:  # else the round stops itself as soon as it has its control
            cancel_step(flight.control)
        if self._averager.is_alive():
            self._averager.shutdown()
        if self._uplink is not None:
            self._uplink.close()  # a probe in flight ends with its stream
        self._executor.shutdown(wait=True)


def cancel_step(control: StepControl) -> None:
    """Cancel hivemind's step; a second cancel (a round called off, then the averager stopped) does nothing, where
    hivemind's own raises InvalidStateError."""
    with suppress(InvalidStateError):
        control.cancel()


SHUTTING_DOWN = "cancelled: the averager is shutting down"
STOP_POLL_S = 0.5  # how soon a round waiting for hivemind's step sees that the averager is shutting down
LARGEST_GROUP = 1000  # for the backstop bound: a butterfly moves at most 2x the slice per peer, whatever the group


def _describe_failure(error: BaseException, find_group_timeout: float) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, CancelledError):
        return SHUTTING_DOWN
    if found_no_group(error):
        return f"no other worker of this stage joined the round within {find_group_timeout:.0f}s"
    if isinstance(error, TimeoutError):
        return "the round did not finish within its time bound"
    return f"{type(error).__name__}: {text}"
