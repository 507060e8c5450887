"""Compressed SPARTA payloads (SpartaConfig.payload) and the error feedback that keeps them from drifting.

Payloads, as hivemind's butterfly all-reduce (hivemind 1.1.12, averaging/allreduce.py) moves them:
- fp32: NoCompression. 4 bytes per value each way; nothing is dropped.
- bf16: BFloat16Compression below. A sender's parts go out in 2 bytes per value. A reducer answers in the
  compression type written in the sender's message, and that type is NONE (see the class). So the averaged
  parts come back as float32: 4 bytes per value.
- int8: hivemind's Uniform8BitQuantization (engine/uniform8bit.py makes it decodable under NumPy 2.4). About
  1 byte per value each way, plus a 1 KiB codebook per part. A reducer's answer (average - the sender's
  decoded part) is quantized too. The error this adds differs from peer to peer, and nothing here corrects
  it; it scales with how far the replicas had drifted apart.
The parts a peer reduces itself are never compressed: hivemind adds them to the average as they are.

Error feedback: hivemind adds the reducer's answer (average - decoded(s)) to the buffer that held what this
peer sent, s. The buffer therefore ends at average + r, where r = s - decoded(s) is what compression dropped.
The slice's new value is the average, buffer - r (ErrorFeedback.averaged). r is kept per partition and added
to what the next round covering that slice sends (ErrorFeedback.compensated). Every round then conserves the
mean over peers of (parameters + residuals). The consensus therefore stays within a quantization step of the
FP32 average, and no slice drifts. Adding buffer - sent to the parameters (the FP32 rule) while also sending
compensated values would count r twice.

The limit of int8 on raw parameters: Uniform8Bit's 256 buckets span ±3 standard deviations of a part, and
every value beyond that range decodes as the mean of its end bucket. Gains near 1 among weights of std 0.02
therefore come back as their bucket's mean. Their residual keeps what they lost, so it is large but does not
grow; the consensus stays off by that much for as long as they remain outliers.
"""

from __future__ import annotations

from typing import Callable, Container, Sequence

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from agora_client.engine.averaging import DEFAULT_PART_SIZE_BYTES
from agora_client.engine.uniform8bit import Uniform8Bit


class BFloat16Compression(CompressionBase):
    """Sends float32 tensors as bfloat16, which has float32's exponent range (so, unlike hivemind's FP16
    classes, nothing overflows) and 8 significant bits. Decoding restores float32.

    hivemind's protobuf has no BFLOAT16 compression type, and a receiving peer decodes a message by that field
    alone, through hivemind's own table (compression/serialization.py). A message is therefore labelled NONE,
    with dtype "bfloat16" and two bytes per value. That is exactly what hivemind's NoCompression.extract decodes
    on any peer, whatever its USE_LEGACY_BFLOAT16 (that setting only changes what NoCompression sends). The
    receiving peer gets a bfloat16 tensor, which its float32 accumulator adds exactly. extract() below also
    returns float32.
    """

    compression_type = runtime_pb2.CompressionType.NONE

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if tensor.dtype != torch.float32:
            raise ValueError(f"{type(self).__name__} sends float32 tensors; got {tensor.dtype}")
        half = tensor.detach().cpu().to(torch.bfloat16)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=half.view(torch.int16).numpy().tobytes(),  # numpy has no bfloat16: the same two bytes as int16
            size=half.shape,
            dtype="bfloat16",
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        tensor = NoCompression().extract(serialized_tensor).to(torch.float32)
        return tensor.requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 16.0 / torch.finfo(info.descriptor.dtype).bits


_PAYLOADS: dict[str, Callable[[], CompressionBase]] = {
    "fp32": NoCompression,
    "bf16": BFloat16Compression,
    "int8": Uniform8Bit,
}


def payload_compression(payload: str) -> CompressionBase:
    """The hivemind compression for a SpartaConfig.payload."""
    if payload not in _PAYLOADS:
        raise ValueError(f"unknown SPARTA payload {payload!r}: use one of {', '.join(_PAYLOADS)}")
    return _PAYLOADS[payload]()


def part_size_values(compression: CompressionBase, part_size_bytes: int, tensor: torch.Tensor) -> int:
    """How many values hivemind puts in each all-reduce part of ``tensor``. Its part_size_bytes counts bytes after
    compression, so a compressed payload fits more values in a part (hivemind's TensorPartContainer rule)."""
    ratio = compression.estimate_compression_ratio(CompressionInfo.from_tensor(tensor, key=0))
    return int(part_size_bytes / (tensor.element_size() * ratio))


@torch.no_grad()
def transmitted_values(
    values: torch.Tensor, compression: CompressionBase, part_values: int, local_parts: Container[int] = ()
) -> torch.Tensor:
    """What the reducers receive of ``values``, in float32. Each part of ``part_values`` values is compressed
    and decoded as hivemind does it, and the parts listed in ``local_parts`` (those this peer reduces itself)
    are kept as they are.

    This relies on hivemind's layout for a one-tensor all-reduce (TensorPartContainer). The flat tensor is cut
    into consecutive parts of ``part_values`` values, counted from its start (see part_size_values). Each part
    is compressed on its own with CompressionInfo.from_tensor(tensor, key=0).get_part(index, part_values), and
    the reducer decodes it with deserialize_torch_tensor. It also relies on the compression being
    deterministic, which NoCompression, BFloat16Compression and Uniform8BitQuantization are. ``values`` must be
    the whole tensor handed to hivemind, i.e. the averager's buffer, padding included, because a part's 8-bit
    codebook depends on every value in that part.
    """
    info = CompressionInfo.from_tensor(values, key=0)
    received = torch.empty(values.shape, dtype=torch.float32)
    parts = zip(values.detach().view(-1).split(part_values), received.view(-1).split(part_values), strict=True)
    for index, (part, out) in enumerate(parts):
        if index in local_parts:
            out.copy_(part)
        else:
            out.copy_(deserialize_torch_tensor(compression.compress(part, info.get_part(index, part_values))))
    return received


class ErrorFeedback:
    """Per SPARTA partition: what compression dropped from this peer's last contribution to that slice.

    A round covering partition p goes like this:
      to_send = feedback.compensated(p, slice_values)      # into the averager's buffer
      ... the all-reduce ...
      feedback.record(p, to_send, transmitted)             # transmitted: transmitted_values(...)[:slice size]
      parameters[slice p] += feedback.averaged(p, buffer[:slice size]) - slice_values

    Host memory: one float32 buffer per partition, the size of its slice, allocated the first time a lossy
    round covers it. Once every partition has been covered, that comes to 4 bytes per trainable parameter of
    the stage. Nothing is allocated while nothing is dropped (fp32). Only one thread (the round's) may use it.
    """

    def __init__(self) -> None:
        self._residuals: dict[int, torch.Tensor] = {}

    def compensated(self, partition: int, values: torch.Tensor) -> torch.Tensor:
        """What to send for slice ``partition``: ``values`` plus what the last round covering it dropped.
        A new tensor, or ``values`` itself if nothing was dropped."""
        residual = self._residual_like(partition, values)
        return values if residual is None else values + residual

    def record(self, partition: int, sent: torch.Tensor, transmitted: torch.Tensor) -> None:
        """After a round: the residual of slice ``partition`` becomes ``sent - transmitted``."""
        residual = self._residual_like(partition, sent)
        if residual is None:
            dropped = sent.float() - transmitted
            if bool(dropped.any()):
                self._residuals[partition] = dropped
        else:
            torch.sub(sent, transmitted, out=residual)

    def averaged(self, partition: int, returned: torch.Tensor) -> torch.Tensor:
        """The slice's averaged values, given the buffer hivemind returned after ``record``: that buffer holds
        the average plus this round's residual, which is what this peer's contribution lost on the wire."""
        residual = self._residual_like(partition, returned)
        return returned if residual is None else returned - residual

    def clear(self) -> None:
        """Forget every residual, e.g. when the parameters are replaced by a checkpoint or a peer's state."""
        self._residuals.clear()

    @property
    def nbytes(self) -> int:
        """Host memory the residuals hold now."""
        return sum(residual.numel() * residual.element_size() for residual in self._residuals.values())

    def _residual_like(self, partition: int, values: torch.Tensor) -> torch.Tensor | None:
        residual = self._residuals.get(partition)
        if residual is not None and residual.shape != values.shape:
            raise ValueError(
                f"slice {partition} has {values.numel()} values but its residual has {residual.numel()}: "
                "the partition layout changed; call clear() after changing the parameters or num_partitions"
            )
        return residual


class SlicePayload:
    """What one SpartaAverager's rounds put on the wire: the compression, the part layout and sizes it implies,
    and the error feedback of a lossy payload. Only the round thread may call outgoing and averaged.

    :param buffer: the averager's float32 buffer (its size and dtype; the values are not read)
    """

    def __init__(self, payload: str, buffer: torch.Tensor):
        self.compression = payload_compression(payload)
        info = CompressionInfo.from_tensor(buffer, key=0)
        self.out_bytes_per_value = buffer.element_size() * self.compression.estimate_compression_ratio(info)
        # a reducer answers in the compression type of the sender's message, and bf16 labels its messages NONE
        lossy_answers = not isinstance(self.compression, BFloat16Compression)
        self.back_bytes_per_value = self.out_bytes_per_value if lossy_answers else float(buffer.element_size())
        # hivemind hands each whole part to one reducer: parts much smaller than a slice spread the load evenly
        # over the group (a slice in one part means one peer reduces everything); 8 KiB keeps headers under 1%
        self.part_size_bytes = min(
            DEFAULT_PART_SIZE_BYTES, max(8 * 1024, int(buffer.numel() * self.out_bytes_per_value) // 64)
        )
        self.part_values = part_size_values(self.compression, self.part_size_bytes, buffer)
        self._padded_size = buffer.numel()
        self._feedback = None if payload == "fp32" else ErrorFeedback()
        self._replaced = False

    @property
    def bytes_per_value(self) -> float:
        """Bytes per slice value a peer sends (and receives) in a butterfly.

        As many parts go out as answers come back."""
        return (self.out_bytes_per_value + self.back_bytes_per_value) / 2

    @property
    def largest_message_bytes(self) -> int:
        """The largest single part or answer of a round."""
        return int(self.part_values * max(self.out_bytes_per_value, self.back_bytes_per_value))

    def parameters_replaced(self) -> None:
        """The parameters were loaded wholesale: what earlier rounds dropped no longer belongs to them. Any thread;
        the round thread forgets the residuals before its next round."""
        self._replaced = True

    def outgoing(self, partition: int, values: torch.Tensor) -> torch.Tensor:
        """What to put in the buffer for slice ``partition``: its values plus what compression dropped last time."""
        if self._feedback is None:
            return values
        if self._replaced:
            self._replaced = False
            self._feedback.clear()
        return self._feedback.compensated(partition, values)

    def averaged(
        self, partition: int, sent: torch.Tensor, returned: torch.Tensor, local_parts: Sequence[int]
    ) -> torch.Tensor:
        """The slice's averaged values after a round that ran: ``sent`` is what outgoing gave, ``returned`` the
        buffer's first len(sent) values after the all-reduce, ``local_parts`` the parts this peer reduced itself."""
        if self._feedback is None:
            return returned
        padded = torch.zeros(self._padded_size, dtype=torch.float32)  # the buffer as hivemind compressed it
        padded[: sent.numel()] = sent
        transmitted = transmitted_values(padded, self.compression, self.part_values, frozenset(local_parts))
        self._feedback.record(partition, sent, transmitted[: sent.numel()])
        return self._feedback.averaged(partition, returned)
