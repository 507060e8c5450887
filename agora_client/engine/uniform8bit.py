"""hivemind's Uniform8BitQuantization with a decoder that works under NumPy 2.4 and later.

hivemind 1.1.12 reads a part's codebook size with int() of a one-element array, which NumPy 2.4 refuses with
a TypeError, so every UNIFORM_8BIT part would fail to decode on the peer receiving it. A peer decodes a part
through hivemind's private table of compression types (deserialize_torch_tensor), keyed by the part's
compression type. Importing this module puts the decoder below in that table, for this process and for the
averager processes it forks after that. The encoding and the wire format are unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import Uniform8BitQuantization, serialization
from hivemind.proto import runtime_pb2

__all__ = ["Uniform8Bit"]


class Uniform8Bit(Uniform8BitQuantization):
    """Encodes as hivemind does; decodes without converting a one-element array to int."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer  # int64 codebook size, float32 codebook, uint8 indices
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        # copies: the message's buffer is read-only, which torch does not allow a tensor to share
        indices = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        lookup = torch.tensor(codebook, dtype=getattr(torch, serialized_tensor.dtype))
        return lookup[indices].requires_grad_(serialized_tensor.requires_grad)


serialization._BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(Uniform8Bit.compression_type)] = Uniform8Bit()
