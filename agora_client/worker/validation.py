"""Reject malformed requests before they reach a task pool.

hivemind's TaskPool concatenates the tensors of several requests into one batch in a separate
process; a request with a wrong shape or dtype would crash that process for everyone, so each
request is checked against the stage's schema in the connection handler first.
"""

from __future__ import annotations

from typing import Sequence

import torch
from hivemind.utils.tensor_descr import BatchTensorDescriptor


class BadRequest(ValueError):
    """A request that does not match the stage's schema; the message says what was wrong."""


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
        raise BadRequest(f"all tensors must share a leading batch dimension, got shapes {[tuple(t.shape) for t in tensors]}")
    batch = batch_sizes.pop()
    if not 1 <= batch <= max_batch_size:
        raise BadRequest(f"batch size {batch} is outside 1..{max_batch_size}")
    for position, (tensor, descriptor) in enumerate(zip(tensors, schema)):
        if tuple(tensor.shape[1:]) != tuple(descriptor.shape[1:]):
            raise BadRequest(
                f"tensor {position} has shape {tuple(tensor.shape)}, expected (batch, {', '.join(map(str, descriptor.shape[1:]))})"
            )
        if tensor.dtype != descriptor.dtype:
            raise BadRequest(f"tensor {position} has dtype {tensor.dtype}, expected {descriptor.dtype}")
        if tensor.is_floating_point():
            if not torch.isfinite(tensor).all():
                raise BadRequest(f"tensor {position} holds NaN or infinite values")
        elif tensor.numel() and (tensor.min() < 0 or tensor.max() >= vocab_size):
            raise BadRequest(f"tensor {position} holds token ids outside 0..{vocab_size - 1}")
