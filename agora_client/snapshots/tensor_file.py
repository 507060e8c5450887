"""A safetensors file read one tensor at a time, straight into tensors that already exist.

safetensors' own reader maps the whole file, and every page read through the map stays counted in this
process's memory until the handle closes. Reading the header here and each tensor's bytes with ``readinto``
into its destination holds nothing beyond the destination; only a destination on a GPU, not contiguous, or
of another dtype takes a temporary of that one tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from .errors import SnapshotError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorFile:
    """The tensors of one safetensors file: ``entries`` (name -> shape, dtype) from its header, each read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # name -> (first byte, end) in the file
        header, data_start = self._header()
        for name, entry in header.items():
            dtype = _DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise SnapshotError(
                    f"{self.path}: {name} has dtype {entry.get('dtype')}, which this client cannot load"
                )
            begin, end = entry["data_offsets"]
            self.entries[name] = (tuple(entry["shape"]), dtype)
            self._spans[name] = (data_start + begin, data_start + end)

    def check_fits(self, targets: dict[str, torch.Tensor]) -> None:
        """The file holds exactly ``targets``' names, with their shapes, floats for floats: else SnapshotError."""
        missing, unexpected = sorted(set(targets) - set(self.entries)), sorted(set(self.entries) - set(targets))
        if missing or unexpected:
            raise SnapshotError(
                f"{self.path} does not fit this stage: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                "it was saved from another stage or model config"
            )
        for name, (shape, dtype) in self.entries.items():
            target = targets[name]
            if shape != tuple(target.shape):
                raise SnapshotError(
                    f"{self.path}: {name} has shape {shape} in the file but {tuple(target.shape)} in this stage; "
                    "it was saved from another model config"
                )
            if dtype.is_floating_point != target.dtype.is_floating_point:
                raise SnapshotError(f"{self.path}: {name} is {dtype} in the file but {target.dtype} in this stage")

    def load_into(self, targets: dict[str, torch.Tensor]) -> None:
        """Check that the file fits ``targets`` (check_fits), then overwrite every one of them from it."""
        self.check_fits(targets)
        with torch.no_grad():
            for name, target in targets.items():
                self.copy_into(name, target)

    def copy_into(self, name: str, target: torch.Tensor) -> None:
        """Overwrite ``target`` (of the entry's shape) with the tensor ``name`` of the file."""
        shape, dtype = self.entries[name]
        direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
        destination = target if direct else torch.empty(shape, dtype=dtype)
        self._read(name, destination)
        if not direct:
            target.copy_(destination)

    def value(self, name: str) -> float | int | bool:
        """A one-element entry (an optimizer's step count, say) as a Python number."""
        shape, dtype = self.entries[name]
        holder = torch.empty(shape, dtype=dtype)
        self._read(name, holder)
        return holder.item()

    def _read(self, name: str, destination: torch.Tensor) -> None:
        begin, end = self._spans[name]
        view = destination.detach().view(-1).view(torch.uint8).numpy()  # the destination's own bytes
        if end - begin != view.nbytes:
            raise SnapshotError(
                f"{self.path}: {name} spans {end - begin} bytes, its shape needs {view.nbytes}; the file is damaged"
            )
        with open(self.path, "rb") as handle:
            handle.seek(begin)
            if view.nbytes and handle.readinto(memoryview(view)) != view.nbytes:
                raise SnapshotError(f"{self.path} ends inside {name}; the file is truncated")

    def _header(self) -> tuple[dict[str, Any], int]:
        """The header (tensor name -> dtype, shape, data_offsets) and where the data begins."""
        try:
            with open(self.path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            header.pop("__metadata__", None)
            if not isinstance(header, dict) or not all(isinstance(entry, dict) for entry in header.values()):
                raise ValueError("its header is not a mapping of tensors")
        except (OSError, struct.error, ValueError) as error:
            raise SnapshotError(f"{self.path} is not a readable safetensors file ({error}); fetch it again") from None
        return header, 8 + length
