"""Compressed SPARTA payloads: what a hivemind peer decodes, and error feedback over simulated rounds (no network)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import runtime_pb2
from pydantic import ValidationError

from agora_client.averaging.compression import (
    BFloat16Compression,
    ErrorFeedback,
    part_size_values,
    payload_compression,
    transmitted_values,
)
from agora_client.averaging.partition import StridedPartition
from agora_client.config import SpartaConfig

BF16_HALF_STEP = 2.0**-8  # rounding to bfloat16's 8 significant bits moves a value by at most this x its magnitude


def _over_the_wire(message: runtime_pb2.Tensor) -> torch.Tensor:
    """What a hivemind peer decodes from a serialized part."""
    return deserialize_torch_tensor(runtime_pb2.Tensor.FromString(message.SerializeToString()))


def test_bf16_parts_decode_on_a_hivemind_peer_within_bfloat16_rounding() -> None:
    torch.manual_seed(0)
    values = torch.cat([torch.randn(10_000) * 0.02, torch.tensor([1e30, -3e38, 1e-30, 0.0])])  # beyond FP16's range
    compression = BFloat16Compression()
    message = compression.compress(values, CompressionInfo.from_tensor(values))
    assert message.compression == runtime_pb2.CompressionType.NONE and len(message.buffer) == 2 * values.numel()

    received = _over_the_wire(message)
    assert received.dtype == torch.bfloat16 and bool(torch.isfinite(received).all())
    assert bool(((received.float() - values).abs() <= values.abs() * BF16_HALF_STEP).all())
    assert torch.equal(compression.extract(message), received.float())
    assert compression.estimate_compression_ratio(CompressionInfo.from_tensor(values)) == 0.5

    # a reducer answers in the sender's compression type, NONE: the averaged part comes back in float32
    answer = serialize_torch_tensor(values - received, message.compression)
    assert len(answer.buffer) == 4 * values.numel()


def test_bf16_refuses_what_it_cannot_restore() -> None:
    values = torch.ones(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        BFloat16Compression().compress(values, CompressionInfo.from_tensor(values))


def test_int8_parts_decode_within_one_quantization_step() -> None:
    torch.manual_seed(1)
    values = torch.randn(20_000) * 0.02 + 0.01
    message = Uniform8BitQuantization().compress(values, CompressionInfo.from_tensor(values))
    assert message.compression == runtime_pb2.UNIFORM_8BIT
    assert len(message.buffer) == values.numel() + 8 + 256 * 4  # one byte a value, plus the codebook

    received = _over_the_wire(message)
    step = _int8_step(values)
    inside = (values - values.mean()).abs() < 3 * values.std() - 2 * step  # the end buckets also take the tails
    assert float((received - values)[inside].abs().max()) <= step


def _int8_step(values: torch.Tensor) -> float:
    """Uniform8BitQuantization's bucket width: 6 standard deviations over 256 buckets."""
    return Uniform8BitQuantization.RANGE_IN_SIGMAS * float(values.std()) / 256


@pytest.mark.parametrize("payload", ["bf16", "int8"])
def test_transmitted_values_are_what_hivemind_sends_each_reducer(payload: str) -> None:
    torch.manual_seed(2)
    values, compression, part_bytes = torch.randn(30_001) * 0.02, payload_compression(payload), 8192
    part_values = part_size_values(compression, part_bytes, values)
    container = TensorPartContainer(
        [values], peer_fractions=[1.0, 1.0, 1.0], compression=compression, part_size_bytes=part_bytes
    )
    own_parts = container.get_raw_input_parts(0)  # this peer is first: it reduces the first parts itself
    assert len(own_parts) > 0 and own_parts[0].numel() == part_values

    async def sent_to_reducers() -> list[torch.Tensor]:
        return [
            _over_the_wire(message).float()
            for reducer in (1, 2)
            async for message in container.iterate_input_parts_for(reducer)
        ]

    expected = torch.cat([*own_parts, *asyncio.run(sent_to_reducers())])
    assert torch.equal(transmitted_values(values, compression, part_values, range(len(own_parts))), expected)
    assert not torch.equal(expected, values)


def test_fp32_payload_drops_nothing_and_keeps_no_residual() -> None:
    values = torch.randn(5000)
    compression = payload_compression("fp32")
    transmitted = transmitted_values(values, compression, part_size_values(compression, 4096, values))
    assert torch.equal(transmitted, values)
    feedback = ErrorFeedback()
    feedback.record(0, values, transmitted)
    assert feedback.nbytes == 0
    assert feedback.compensated(0, values) is values and feedback.averaged(0, values) is values


def test_payload_names_are_checked() -> None:
    assert SpartaConfig().payload == "fp32"
    assert SpartaConfig(payload="int8").payload == "int8"
    with pytest.raises(ValidationError):
        SpartaConfig(payload="fp16")
    with pytest.raises(ValueError, match="fp32, bf16, int8"):
        payload_compression("fp16")


def test_a_residual_of_another_size_says_what_to_do() -> None:
    feedback = ErrorFeedback()
    feedback.record(3, torch.ones(10), torch.zeros(10))
    assert feedback.nbytes == 40
    with pytest.raises(ValueError, match="clear"):
        feedback.compensated(3, torch.ones(11))
    feedback.clear()
    assert feedback.nbytes == 0


@dataclass(frozen=True)
class _Round:
    part: int
    step: torch.Tensor  # per element of the slice: the largest quantization step among the peers' contributions
    residual: float  # the largest residual a peer's contribution left behind


class _SimulatedStage:
    """Peers of one stage averaging rotating slices as hivemind's butterfly all-reduce does: each part is
    reduced by one peer, from its own values as they are and the other peers' decoded ones; each sender gets
    back (average - its decoded part), compressed in its part's compression type, added to its buffer."""

    def __init__(self, params: list[torch.Tensor], payload: str, partitions: int, part_bytes: int = 4096):
        self.params, self.payload, self.compression = params, payload, payload_compression(payload)
        self.partition = StridedPartition([params[0].numel()], partitions)
        self.feedback = [ErrorFeedback() for _ in params]
        self.part_values = part_size_values(self.compression, part_bytes, torch.zeros(self.partition.max_slice_size))

    def round(self, round_no: int, remember: bool = True) -> _Round:
        """Averages slice round_no mod P."""
        part, peers = round_no % self.partition.num_partitions, range(len(self.params))
        if not remember:  # error feedback without memory: what compression drops is lost
            self.feedback = [ErrorFeedback() for _ in peers]
        size = self.partition.slice_size(part)
        parts = -(-self.partition.max_slice_size // self.part_values)
        reducer_of = [index * len(self.params) // parts for index in range(parts)]
        slices = [self.slice_of(self.params[peer], part) for peer in peers]
        buffers = [torch.zeros(self.partition.max_slice_size) for _ in peers]
        for peer in peers:
            buffers[peer][:size] = self.feedback[peer].compensated(part, slices[peer])
        sent = [buffer.clone() for buffer in buffers]
        own_parts = [[index for index, reducer in enumerate(reducer_of) if reducer == peer] for peer in peers]
        received = [
            transmitted_values(values, self.compression, self.part_values, own)
            for values, own in zip(sent, own_parts, strict=True)
        ]
        for index, reducer in enumerate(reducer_of):
            chunk = slice(index * self.part_values, (index + 1) * self.part_values)
            average = torch.stack([values[chunk] for values in received]).mean(0)
            for peer in peers:
                buffers[peer][chunk] += _answer(average - received[peer][chunk], self.compression, peer == reducer)
        for peer in peers:
            self.feedback[peer].record(part, sent[peer][:size], received[peer][:size])
            averaged = self.feedback[peer].averaged(part, buffers[peer][:size])
            self.partition.add_([self.params[peer]], part, averaged - slices[peer])
        step = torch.stack([self._step(values) for values in sent]).amax(0)[:size]
        residual = max(float((values - got).abs().max()) for values, got in zip(sent, received, strict=True))
        return _Round(part, step, residual)

    def _step(self, values: torch.Tensor) -> torch.Tensor:
        """One quantization step per element: a bf16 unit in the last place, or the 8-bit bucket of its part."""
        if self.payload == "bf16":
            return values.abs() * 2 * BF16_HALF_STEP
        return torch.cat([torch.full_like(chunk, _int8_step(chunk)) for chunk in values.split(self.part_values)])

    def slice_of(self, values: torch.Tensor, part: int) -> torch.Tensor:
        out = torch.zeros(self.partition.slice_size(part))
        self.partition.gather([values], part, out)
        return out


def _answer(delta: torch.Tensor, compression: CompressionBase, local: bool) -> torch.Tensor:
    """What a sender adds to its buffer for one part: exact from itself, else the reducer's serialized answer."""
    if local:
        return delta
    return deserialize_torch_tensor(serialize_torch_tensor(delta, compression.compression_type)).float()


def _tail_free(size: int) -> torch.Tensor:
    """Values without tails: uniform ones lie within ±1.8 standard deviations, inside Uniform8Bit's ±3."""
    return (torch.rand(size) * 2 - 1) * 0.03


@pytest.mark.parametrize("payload", ["bf16", "int8"])
def test_two_rounds_over_a_slice_reach_the_fp32_average_within_a_step(payload: str) -> None:
    torch.manual_seed(3)
    params = [_tail_free(20_001) + 0.003 * peer for peer in range(3)]
    fp32_average = torch.stack(params).mean(0)
    stage = _SimulatedStage([value.clone() for value in params], payload, partitions=2)
    last = {}
    for round_no in range(4):  # every slice covered twice
        last[round_no % 2] = stage.round(round_no)
    for part, result in last.items():
        for peer_values in stage.params:
            error = (stage.slice_of(peer_values, part) - stage.slice_of(fp32_average, part)).abs()
            assert bool((error <= result.step).all()), f"{payload}: {float((error / result.step).max()):.3g} steps off"
    # bf16 answers come back in float32: the replicas agree. int8 answers are quantized, each peer's on its own:
    # the replicas then differ by up to a step of the answers (average - their own part), no more than a step here
    spread = float((stage.params[0] - stage.params[1]).abs().max())
    assert spread <= (1e-8 if payload == "bf16" else float(result.step.min())), f"replicas {spread:.3g} apart"


def _train_and_average(payload: str, params: list[torch.Tensor], rounds: int) -> tuple[list[float], list[float]]:
    """Rounds over 2 slices, each after every peer moved its values by its own small update (far below a bf16
    step). Returns, per round, the largest residual and how far the averaged slice is from the FP32 stage's,
    in quantization steps."""
    updates = [torch.randn(params[0].numel()) * 1e-5 for _ in params]
    fp32_average = torch.stack(params).mean(0)  # under exact averaging only the updates move the stage's mean
    stage = _SimulatedStage([value.clone() for value in params], payload, partitions=2)
    residuals, errors = [], []
    for round_no in range(rounds):
        for peer_values, update in zip(stage.params, updates, strict=True):
            peer_values += update
        fp32_average += torch.stack(updates).mean(0)
        result = stage.round(round_no)
        error = (stage.slice_of(stage.params[0], result.part) - stage.slice_of(fp32_average, result.part)).abs()
        residuals.append(result.residual)
        errors.append(float((error / result.step).max()))
    return residuals, errors


@pytest.mark.parametrize("payload", ["bf16", "int8"])
def test_residuals_stay_bounded_while_training_moves_the_values(payload: str) -> None:
    torch.manual_seed(4)
    residuals, errors = _train_and_average(payload, [_tail_free(20_001) for _ in range(3)], rounds=50)
    assert max(residuals[-10:]) <= 1.5 * max(residuals[:10]), f"{payload}: residuals grew: {residuals}"
    assert max(errors) <= 1.0, f"{payload}: the averaged slice left the FP32 average by {max(errors):.3g} steps"


def test_int8_values_beyond_three_sigma_keep_a_residual_that_does_not_grow() -> None:
    """Uniform8Bit's end buckets take every value beyond ±3 sigma of its part: gains near 1 among weights of
    std 0.02 come back as their bucket's mean. What they lose stays in their residual: large, never growing."""
    torch.manual_seed(5)
    params = [torch.randn(10_001) * 0.02 for _ in range(3)]
    for values in params:
        values[::500] = 1.0 + 0.05 * torch.randn(values[::500].shape)
    residuals, errors = _train_and_average("int8", params, rounds=20)
    assert max(residuals) > 0.05 and max(errors) > 10  # the limit of 8-bit payloads on mixed scales
    assert max(residuals[-10:]) <= 1.01 * max(residuals[:10]) and max(errors[-10:]) <= 1.01 * max(errors[:10])


def test_without_memory_bf16_rounds_lose_small_updates() -> None:
    """The same rounds without error feedback drift away from the FP32 average: the check above can fail."""
    torch.manual_seed(4)
    params = [torch.randn(20_001) * 0.02 for _ in range(3)]
    update = torch.full((20_001,), 1e-5) * torch.sign(params[0])  # always away from zero: bf16 rounds it off
    fp32_total = torch.stack(params).mean(0) + 50 * update
    stage = _SimulatedStage([value.clone() for value in params], "bf16", partitions=2)
    for round_no in range(50):
        for peer_values in stage.params:
            peer_values += update
        stage.round(round_no, remember=False)
    error = (stage.params[0] - fp32_total).abs() / (fp32_total.abs() * 2 * BF16_HALF_STEP)
    assert float(error.max()) > 2.0


def test_peers_on_different_payloads_never_match() -> None:
    """Their parts hold different numbers of values, so hivemind's matchmaking must keep them apart: the payload
    is part of the averager's schema hash, which a group's members must share."""
    import threading

    from hivemind import DHT

    from agora_client.averaging.sparta import SpartaAverager

    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        parameters = [torch.nn.Parameter(torch.randn(4000))]
        fp32, bf16, int8, int8_again = (
            SpartaAverager(
                dht, "payloads", parameters, SpartaConfig(payload=payload), lock=threading.Lock(), start=False
            )._averager.schema_hash
            for payload in ("fp32", "bf16", "int8", "int8")
        )
        assert int8 == int8_again and len({fp32, bf16, int8}) == 3
    finally:
        dht.shutdown()
