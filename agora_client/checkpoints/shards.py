"""Tensors written as they come into Hugging Face safetensors shards, at most one shard held in memory (and its
memory handed back to the system once written).

The layout is the one ``transformers`` writes and reads: ``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` ({"metadata": {"total_size"}, "weight_map": {name: file}}), or a single
``model.safetensors`` with no index when everything fits one shard. The shard count is known only at the
end, so shards are written under provisional names and renamed by ``finish``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes from ``5GB``, ``500MB``, ``2GiB`` or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size: write bytes or a number with KB, MB, GB, KiB, MiB or GiB, e.g. 5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def release_freed_memory() -> None:
    """Hand freed memory back to the system: glibc keeps freed blocks under its mmap threshold (up to 32 MiB) in its
    heap, where tensors of other sizes cannot always reuse them, so a writer's peak would creep up shard by shard."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


class ShardWriter:
    """Collects tensors into the current shard and writes it out once the next tensor would overflow it."""

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.directory, self.max_shard_bytes = Path(directory), max_shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.written: list[list[str]] = []  # the names in each flushed shard, in order
        self.names: set[str] = set()
        self.total_bytes = 0
        self.largest_shard_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name} was written twice")
        self.names.add(name)
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self.flush()
        self.current[name] = tensor.contiguous()  # a tensor above the limit gets a shard of its own
        self.current_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        """Write the current shard and drop its tensors."""
        if not self.current:
            return
        save_file(self.current, str(self._provisional(len(self.written))), metadata={"format": "pt"})
        self.written.append(list(self.current))
        self.largest_shard_bytes = max(self.largest_shard_bytes, self.current_bytes)
        self.current, self.current_bytes = {}, 0
        release_freed_memory()

    def finish(self) -> list[Path]:
        """Flush, give every shard its final name (and write the index if there are several); returns the files."""
        self.flush()
        count = len(self.written)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for index, name in enumerate(names):
            os.rename(self._provisional(index), self.directory / name)
        files = [self.directory / name for name in names]
        if count > 1:
            weight_map = {tensor: name for name, shard in zip(names, self.written, strict=True) for tensor in shard}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
            files.append(self.directory / INDEX_FILE)
        return files

    def _provisional(self, index: int) -> Path:
        return self.directory / f".shard-{index:05d}.safetensors"
