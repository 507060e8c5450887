"""Reject malformed, oversized or poisonous requests before they reach a task pool.

hivemind's TaskPool concatenates the tensors of several requests into one batch in a separate
process; a request with a wrong shape or dtype would crash that process for everyone, and one with
absurd values would poison the stage's weights. So each request is checked in the connection handler,
in three steps:
- ``DescriptorCheck``: the declared shape, dtype and byte size of every serialized tensor, before its
  buffer is deserialized (and, for a streamed request, before later parts are accepted);
- ``validate_inputs``: the deserialized tensors against the stage's schema and vocabulary;
- ``MagnitudeGuard``: float values against an absolute ceiling and the running magnitude of what this
  worker has accepted so far.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.tensor_descr import BatchTensorDescriptor

ABSOLUTE_LIMIT = 1e6  # no activation or gradient of a healthy stage comes near this
OUTLIER_ORDERS = 3.0  # refuse magnitudes more than 10**3 times the running typical one
WARMUP_REQUESTS = 16  # accepted requests before the running statistics are trusted
_STATS_DECAY = 0.98
_BYTES_SLACK = 4096  # compressed encodings carry a small header (e.g. a quantile table)


class RequestRejected(ValueError):
    """A request this worker refuses; ``reason`` is a short category for counters, the message says what to do."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class BadRequest(RequestRejected):
    """A request that does not match the stage's schema or limits."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(reason, message)


class DescriptorCheck:
    """Checks serialized tensors part by part from their headers, before their payload is deserialized.

    The first part of each tensor declares its shape and dtype; every byte that follows is counted
    against what that shape can hold, so an oversized stream is refused after at most one extra part.
    """

    def __init__(self, schema: Sequence[BatchTensorDescriptor], max_batch_size: int):
        self.schema, self.max_batch_size = schema, max_batch_size
        self._wire = [serialize_torch_tensor(torch.zeros(1, dtype=d.dtype)) for d in schema]
        self._index, self._budget, self._batch = -1, 0, None
        self._exact = False  # uncompressed tensors must carry exactly the bytes their shape needs

    def feed(self, parts: Iterable[runtime_pb2.Tensor]) -> None:
        for part in parts:
            if part.dtype:  # the header part of the next tensor
                self._end_tensor()
                self._start_tensor(part)
            elif self._index < 0:
                raise BadRequest("a tensor part arrived before any tensor header; send serialized hivemind tensors")
            self._budget -= len(part.buffer)
            if self._budget < 0:
                raise BadRequest(
                    f"tensor {self._index} carries more bytes than its declared shape {tuple(self._declared)} holds",
                    reason="oversized",
                )

    def _end_tensor(self) -> None:
        if self._index >= 0 and self._exact and self._budget != _BYTES_SLACK:
            raise BadRequest(
                f"tensor {self._index} is {_BYTES_SLACK - self._budget} bytes short of its declared shape "
                f"{tuple(self._declared)}"
            )

    def _start_tensor(self, part: runtime_pb2.Tensor) -> None:
        self._index += 1
        if self._index >= len(self.schema):
            raise BadRequest(f"expected {len(self.schema)} tensors, got more")
        descriptor = self.schema[self._index]
        declared = self._declared = tuple(part.size)
        expected_tail = tuple(descriptor.shape[1:])
        if len(declared) != len(descriptor.shape) or declared[1:] != expected_tail:
            raise BadRequest(
                f"tensor {self._index} has shape {declared}, expected (batch, {', '.join(map(str, expected_tail))})"
            )
        batch = declared[0]
        if not 1 <= batch <= self.max_batch_size:
            raise BadRequest(
                f"batch size {batch} is outside 1..{self.max_batch_size}, the stage's largest microbatch; "
                "split the request",
                reason="oversized" if batch > self.max_batch_size else "malformed",
            )
        if self._batch is not None and batch != self._batch:
            raise BadRequest(f"all tensors must share a leading batch dimension, got {self._batch} and {batch}")
        self._batch = batch
        wire = self._wire[self._index]
        if part.dtype != wire.dtype:
            raise BadRequest(f"tensor {self._index} has dtype {part.dtype}, expected {wire.dtype}")
        element_bytes = len(wire.buffer)  # bytes per element on the wire (bf16 travels as fp32)
        self._budget = batch * math.prod(expected_tail) * element_bytes + _BYTES_SLACK
        self._exact = part.compression == runtime_pb2.CompressionType.NONE

    def largest_request_bytes(self) -> int:
        """Payload bytes of the largest request the schema allows (every tensor at the largest batch)."""
        return sum(
            self.max_batch_size * math.prod(descriptor.shape[1:]) * len(wire.buffer) + _BYTES_SLACK
            for descriptor, wire in zip(self.schema, self._wire, strict=True)
        )

    def finish(self) -> None:
        self._end_tensor()
        if self._index + 1 != len(self.schema):
            raise BadRequest(f"expected {len(self.schema)} tensors, got {self._index + 1}")


def check_descriptors(
    tensors: Sequence[runtime_pb2.Tensor], schema: Sequence[BatchTensorDescriptor], max_batch_size: int
) -> None:
    """The whole-message form of DescriptorCheck (unary requests)."""
    check = DescriptorCheck(schema, max_batch_size)
    check.feed(tensors)
    check.finish()


def validate_inputs(
    tensors: Sequence[torch.Tensor],
    schema: Sequence[BatchTensorDescriptor],
    *,
    vocab_size: int,
    max_batch_size: int,
) -> None:
    if len(tensors) != len(schema):
        raise BadRequest(f"expected {len(schema)} tensors, got {len(tensors)}")
    batch_sizes = {tensor.shape[0] if tensor.dim() else None for tensor in tensors}
    if len(batch_sizes) != 1 or None in batch_sizes:
        raise BadRequest(
            f"all tensors must share a leading batch dimension, got shapes {[tuple(t.shape) for t in tensors]}"
        )
    batch = batch_sizes.pop()
    if not 1 <= batch <= max_batch_size:
        raise BadRequest(f"batch size {batch} is outside 1..{max_batch_size}")
    for position, (tensor, descriptor) in enumerate(zip(tensors, schema, strict=True)):
        if tuple(tensor.shape[1:]) != tuple(descriptor.shape[1:]):
            raise BadRequest(
                f"tensor {position} has shape {tuple(tensor.shape)}, expected (batch, "
                f"{', '.join(map(str, descriptor.shape[1:]))})"
            )
        if tensor.dtype != descriptor.dtype:
            raise BadRequest(f"tensor {position} has dtype {tensor.dtype}, expected {descriptor.dtype}")
        if tensor.is_floating_point():
            if not torch.isfinite(tensor).all():
                raise BadRequest(f"tensor {position} holds NaN or infinite values", reason="non_finite")
        elif tensor.numel() and (tensor.min() < 0 or tensor.max() >= vocab_size):
            raise BadRequest(f"tensor {position} holds token ids outside 0..{vocab_size - 1}")


class MagnitudeGuard:
    """Running typical magnitude (log10 of RMS and of peak) of every float input of one RPC kind.

    Only high outliers are refused: values far smaller than usual cannot poison weights. The first
    ``WARMUP_REQUESTS`` requests meet only the absolute ceiling; statistics follow accepted requests only.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.count = 0
        self._levels: dict[tuple[int, str], float] = {}

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raise BadRequest for a far outlier; otherwise fold the request into the statistics."""
        measured: dict[tuple[int, str], float] = {}
        for position, tensor in enumerate(tensors):
            if not tensor.is_floating_point() or not tensor.numel():
                continue
            values = tensor.detach().float()
            peak = float(values.abs().max())
            if peak > ABSOLUTE_LIMIT:
                raise BadRequest(
                    f"{self.kind} tensor {position} holds values up to {peak:.3g}, over the limit "
                    f"{ABSOLUTE_LIMIT:.0e} for any activation or gradient",
                    reason="too_large",
                )
            for statistic, value in (("rms", float(values.pow(2).mean().sqrt())), ("peak", peak)):
                if value > 0:
                    measured[position, statistic] = math.log10(value)
        if self.count >= WARMUP_REQUESTS:
            for key, level in measured.items():
                typical = self._levels.get(key)
                if typical is not None and level - typical > OUTLIER_ORDERS:
                    raise BadRequest(
                        f"{self.kind} tensor {key[0]} has {key[1]} magnitude {10**level:.3g}, over "
                        f"{10**OUTLIER_ORDERS:.0f}x this stage's running typical {10**typical:.3g}",
                        reason="outlier",
                    )
        self.count += 1
        weight = max(1.0 / self.count, 1.0 - _STATS_DECAY)  # a plain mean while warming up, then an EMA
        for key, level in measured.items():
            typical = self._levels.get(key, level)
            self._levels[key] = typical + weight * (level - typical)
