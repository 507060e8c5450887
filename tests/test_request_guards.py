"""The worker's request guards as units: tickets, tensor headers, value magnitudes, the step guard,
plus the trainer's side (self-issued tickets, non-finite loss). The same guards on a real worker:
test_fuzz_worker.py."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.auth.ticket_source import HeldTicket, SelfIssuedTickets
from agora_client.auth.tickets import generate_signing_key, issue_ticket, public_key_text, verify_ticket
from agora_client.config import SyncConfig
from agora_client.discovery.roster import WorkerRecord
from agora_client.serving.backend import WorkerUnhealthy
from agora_client.serving.rejections import RejectionLog
from agora_client.serving.ticket_gate import TicketGate, TicketRejected
from agora_client.serving.validation import (
    ABSOLUTE_LIMIT,
    WARMUP_REQUESTS,
    BadRequest,
    DescriptorCheck,
    MagnitudeGuard,
    check_descriptors,
)
from agora_client.trainer.balancer import Router, StageBalancer
from agora_client.trainer.errors import ErrorClass, classify
from agora_client.trainer.pipeline import NonFiniteLoss, Pipeline, StallNotice
from agora_client.worker.epochs import EpochController
from agora_client.worker.sync import SyncState

CALLER = "12D3KooWcaller"
KEY = generate_signing_key()


def ticket(role: str = "trainer", peer_id: str = CALLER, stage: str = "trainer", key=KEY, **kwargs) -> bytes:
    kwargs.setdefault("ttl_s", 6 * 3600)  # built at collection time: must outlive a slow suite
    return issue_ticket(key, identity="op", peer_id=peer_id, stage=stage, slot=0, role=role, **kwargs).encode()


# tickets -----------------------------------------------------------------------------------------


def test_gate_accepts_a_trainer_ticket_from_the_peer_it_names() -> None:
    claims = TicketGate(public_key_text(KEY), roles=("trainer",)).check(ticket(), CALLER)
    assert (claims.role, claims.peer_id) == ("trainer", CALLER)


@pytest.mark.parametrize(
    "presented, reason, says",
    [
        (b"", "no_ticket", "carries no ticket"),
        (b"\xff\xfe garbage", "malformed_ticket", "not ASCII"),
        (b"not-a-ticket", "malformed_ticket", "malformed ticket"),
        (ticket(now=time.time() - 7200, ttl_s=60), "expired_ticket", "expired"),
        (ticket(key=generate_signing_key()), "bad_signature_ticket", "signature does not match"),
        (ticket(role="worker"), "wrong_role", "a worker ticket may not make this call"),
        (ticket(peer_id="12D3KooWsomeoneelse"), "wrong_peer", "not to the caller"),
    ],
    ids=["missing", "not_ascii", "malformed", "expired", "forged", "wrong_role", "wrong_peer"],
)
def test_gate_refuses_with_a_reason(presented: bytes, reason: str, says: str) -> None:
    with pytest.raises(TicketRejected, match=says) as refused:
        TicketGate(public_key_text(KEY), roles=("trainer",)).check(presented, CALLER)
    assert refused.value.reason == reason


def test_averaging_gate_admits_only_workers_of_its_own_stage() -> None:
    gate = TicketGate(public_key_text(KEY), roles=("worker",), stage="body1")
    assert gate.check(ticket(role="worker", stage="body1"), CALLER).stage == "body1"
    with pytest.raises(TicketRejected, match="only body1 peers") as refused:
        gate.check(ticket(role="worker", stage="body2"), CALLER)
    assert refused.value.reason == "wrong_stage"


def test_a_remembered_ticket_still_expires() -> None:
    gate = TicketGate(public_key_text(KEY), roles=("trainer",))
    presented = ticket(ttl_s=10)
    gate.check(presented, CALLER)
    with pytest.raises(TicketRejected, match="expired"):
        gate.check(presented, CALLER, now=time.time() + 20)


def test_self_issued_tickets_name_the_calling_peer_and_the_role() -> None:
    source = SelfIssuedTickets(KEY, role="trainer", stage="trainer")
    first, other = source.ticket_for("peerA"), source.ticket_for("peerB")
    assert source.ticket_for("peerA") == first  # reused until close to expiry
    assert verify_ticket(source.public_key, first).peer_id == "peerA"
    assert verify_ticket(source.public_key, other).role == "trainer"
    held = HeldTicket("t1")
    held.replace("t2")
    assert held.ticket_for("anyone") == "t2"


def test_tickets_without_a_role_claim_are_workers_tickets() -> None:
    claims = verify_ticket(public_key_text(KEY), ticket(role="worker").decode())
    assert claims.role == "worker"


# tensor headers, before deserialization -----------------------------------------------------------

SCHEMA = (
    BatchTensorDescriptor.from_tensor(torch.zeros(1, 16, 4)),
    BatchTensorDescriptor.from_tensor(torch.zeros(1, 16, dtype=torch.int64)),
)


def protos(*tensors: torch.Tensor) -> list[runtime_pb2.Tensor]:
    return [serialize_torch_tensor(tensor) for tensor in tensors]


def test_headers_of_a_legal_request_pass() -> None:
    check_descriptors(protos(torch.zeros(8, 16, 4), torch.zeros(8, 16, dtype=torch.int64)), SCHEMA, 8)


@pytest.mark.parametrize(
    "tensors, reason, says",
    [
        ((torch.zeros(9, 16, 4), torch.zeros(9, 16, dtype=torch.int64)), "oversized", "outside 1..8"),
        ((torch.zeros(0, 16, 4), torch.zeros(0, 16, dtype=torch.int64)), "malformed", "outside 1..8"),
        ((torch.zeros(2, 15, 4), torch.zeros(2, 16, dtype=torch.int64)), "malformed", r"expected \(batch, 16, 4\)"),
        (
            (torch.zeros(2, 16, 4, dtype=torch.float64), torch.zeros(2, 16, dtype=torch.int64)),
            "malformed",
            "dtype float64",
        ),
        ((torch.zeros(2, 16, 4),), "malformed", "expected 2 tensors, got 1"),
        ((torch.zeros(2, 16, 4), torch.zeros(2, 16, dtype=torch.int64), torch.zeros(2)), "malformed", "got more"),
        ((torch.zeros(2, 16, 4), torch.zeros(3, 16, dtype=torch.int64)), "malformed", "share a leading batch"),
    ],
)
def test_bad_headers_are_refused(tensors, reason: str, says: str) -> None:
    with pytest.raises(BadRequest, match=says) as refused:
        check_descriptors(protos(*tensors), SCHEMA, 8)
    assert refused.value.reason == reason


def test_a_stream_carrying_more_than_its_declared_shape_is_cut_off_at_the_first_extra_part() -> None:
    header = serialize_torch_tensor(torch.zeros(1, 16, 4))
    check = DescriptorCheck(SCHEMA, 8)
    check.feed([header])
    with pytest.raises(BadRequest, match="more bytes than its declared shape") as refused:
        check.feed([runtime_pb2.Tensor(buffer=bytes(8192))])
    assert refused.value.reason == "oversized"


def test_a_streamed_request_in_parts_passes_and_a_short_buffer_is_refused() -> None:
    check = DescriptorCheck(SCHEMA, 8)
    for proto in protos(torch.zeros(8, 16, 4), torch.zeros(8, 16, dtype=torch.int64)):
        check.feed(split_for_streaming(proto, 100))
    check.finish()
    short = serialize_torch_tensor(torch.zeros(2, 16, 4))
    short.buffer = short.buffer[:-4]
    with pytest.raises(BadRequest, match="4 bytes short"):
        check_descriptors([short, *protos(torch.zeros(2, 16, dtype=torch.int64))], SCHEMA, 8)


# values -------------------------------------------------------------------------------------------


def test_a_huge_finite_value_is_refused_from_the_first_request() -> None:
    with pytest.raises(BadRequest, match="over the limit") as refused:
        MagnitudeGuard("forward").check([torch.full((2, 3), 1e20)])
    assert refused.value.reason == "too_large"


def test_outliers_against_the_running_statistics_are_refused_and_do_not_move_them() -> None:
    guard = MagnitudeGuard("backward")
    tokens = torch.zeros(4, 3000, dtype=torch.int64)
    for step in range(WARMUP_REQUESTS + 4):
        guard.check([torch.randn(4, 3000) * 0.01 * (1 + step % 3), tokens])
    before = (guard.count, dict(guard._levels))
    with pytest.raises(BadRequest, match="rms magnitude .* running typical") as refused:
        guard.check([torch.randn(4, 3000) * 0.01 * 1e4, tokens])
    assert refused.value.reason == "outlier"
    assert (guard.count, guard._levels) == before
    assert ABSOLUTE_LIMIT > 0.01 * 1e4 * 10  # the relative check caught it, not the ceiling
    guard.check([torch.randn(4, 3000) * 0.05, tokens])  # normal traffic still passes
    one_spike = torch.randn(4, 3000) * 0.01
    one_spike[0, 0] = 1e3
    with pytest.raises(BadRequest, match="peak magnitude"):
        guard.check([one_spike, tokens])


def test_rejections_are_counted_and_logged_once_per_peer_per_interval() -> None:
    lines: list[str] = []
    log = RejectionLog(lines.append, interval=60)
    for _ in range(3):
        log._record("peerA", "no_ticket", "no ticket")
    log._record("peerB", "outlier", "too big")
    assert log.counts == {"no_ticket": 3, "outlier": 1}
    assert len(lines) == 2 and "peerA" in lines[0] and "peerB" in lines[1]


# the optimizer step guard -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dht():
    node = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def controller(dht: DHT, parameters, notes: list[str]) -> EpochController:
    sync = SyncState(SyncConfig(), lambda event: None, joining=False)
    return EpochController(
        dht,
        f"guard{len(notes)}{time.monotonic_ns()}",
        parameters,
        torch.optim.SGD(parameters, lr=0.1),
        target_batch_size=4,
        clip_norm=1.0,
        sync=sync,
        on_epoch=lambda epoch: None,
        on_error=notes.append,
        on_skipped_step=lambda message: notes.append(f"skipped: {message}"),
        on_corrupt_weights=lambda message: notes.append(f"corrupt: {message}"),
    )


def test_a_non_finite_gradient_is_never_applied(dht: DHT) -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    notes: list[str] = []
    epochs = controller(dht, [weight], notes)
    try:
        weight.grad = torch.tensor([1.0, math.nan, 1.0])
        epochs.local_samples = 1
        epochs._step()
        assert torch.equal(weight.detach(), torch.ones(3)) and weight.grad is None
        assert epochs.skipped_steps == 1 and notes[0].startswith("skipped:") and "last good weights" in notes[0]
        weight.grad = torch.ones(3)
        epochs.local_samples = 1
        epochs._step()
        assert torch.all(weight.detach() < 1) and len(notes) == 1  # a finite gradient steps as before
    finally:
        epochs.shutdown()


def test_weights_that_turn_non_finite_in_a_step_are_reported(dht: DHT) -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    notes: list[str] = []
    epochs = controller(dht, [weight], notes)
    epochs.optimizer = torch.optim.SGD([weight], lr=math.inf)  # any optimizer: only step() is relied on
    try:
        weight.grad = torch.ones(3)
        epochs.local_samples = 1
        epochs._step()
        assert notes and notes[0].startswith("corrupt:")
    finally:
        epochs.shutdown()


# routing and the trainer ---------------------------------------------------------------------------


def test_unhealthy_workers_leave_routing() -> None:
    balancer = StageBalancer("body1")
    record = dict(peer_id="p", stage="body1", sync_phase=0)
    balancer.update_roster(
        [
            WorkerRecord(uid="body1.0.0", healthy=False, **record),
            WorkerRecord(uid="body1.0.1", **record | {"peer_id": "q"}),
        ]
    )
    assert {balancer.choose().worker.uid for _ in range(4)} == {"body1.0.1"}


class FakeClient:
    def __init__(self, loss: float):
        self.loss, self.backwards = loss, 0

    def forward(self, worker, inputs):
        batch = inputs[-1].shape[0]
        return [torch.full((batch,), self.loss)] if worker.stage == "tail" else [torch.zeros(batch, 4)]

    def backward(self, worker, inputs, grad_outputs):
        self.backwards += 1
        return [torch.zeros_like(inputs[0], dtype=torch.float32)]


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_microbatch_with_a_non_finite_loss_is_dropped_before_backward(loss: float) -> None:
    stages = ["head", "tail"]
    router = Router(stages, lambda stage: StageBalancer(stage))
    for stage in stages:
        router[stage].update_roster([WorkerRecord(uid=f"{stage}.0.0", peer_id=f"p-{stage}", stage=stage)])
    client = FakeClient(loss)
    pipeline = Pipeline(stages, {stage: client for stage in stages}, router, StallNotice(lambda message: None))
    with pytest.raises(NonFiniteLoss, match="tail.0.0 is not finite"):
        pipeline.train_microbatch(torch.zeros(2, 9, dtype=torch.int64))
    assert client.backwards == 0
    healthy = FakeClient(2.0)
    pipeline = Pipeline(stages, {stage: healthy for stage in stages}, router, StallNotice(lambda message: None))
    assert pipeline.train_microbatch(torch.zeros(2, 9, dtype=torch.int64)) == pytest.approx(2.0)
    assert healthy.backwards == 2


def test_trainers_move_off_an_unhealthy_worker_and_give_up_on_a_refused_request() -> None:
    assert classify(P2PHandlerError(repr(WorkerUnhealthy(WorkerUnhealthy.MESSAGE)))) is ErrorClass.RETRY_OTHER
    refused = TicketRejected("expired_ticket", "ticket expired 12s ago; join the swarm again for a new one")
    assert classify(P2PHandlerError(repr(refused))) is ErrorClass.FATAL
    oversized = BadRequest(
        "batch size 64 is outside 1..8, the stage's largest microbatch; split the request", "oversized"
    )
    assert (
        classify(P2PHandlerError(f"Failed to call handler `rpc_forward_stream` at 12D3: {oversized}"))
        is ErrorClass.FATAL
    )
