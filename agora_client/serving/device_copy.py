"""The offload layout's GPU side (agora_client/model/memory.py, LAYOUTS): a bf16 copy of the stage on the device,
fed from fp32 master weights on the host, feeding an fp32 gradient sum there.

The worker's module stays the fp32 master: the optimizer, SPARTA, snapshots, checkpoints and exports read it exactly
as in the fp32 layout, so nothing they write changes format. Requests run on the bf16 copy. Each gradient leaves the
device as soon as backward has made it (a hook copies it into a pinned bf16 staging buffer and frees it), and once
the backward is done the host adds the staging buffer into the masters' fp32 ``.grad``. Before each request the copy
is refreshed from the masters if anything wrote them since (the optimizer step, a SPARTA round, a snapshot load):
torch counts every in-place write to a tensor in its ``_version``.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch

from agora_client.config import ModelConfig
from agora_client.model import build_stage
from agora_client.model.stages import StageModule

COPY_DTYPE = torch.bfloat16


class DeviceCopy:
    """The bf16 copy of ``master`` on ``device``; call ``refresh()`` before a request and ``collect_gradients()``
    after a backward, both under the lock that guards the masters."""

    def __init__(self, master: StageModule, config: ModelConfig, device: str | torch.device, *, seed: int):
        """``seed``: the one ``master`` was built with (U and E_f come from it)."""
        self.device = torch.device(device)
        self.module = build_stage(
            config,
            master.stage,
            seed=seed,
            device=self.device,
            compress_boundary=master.compress_boundary,
            seeded_weights=False,
            weight_dtype=COPY_DTYPE,
        )
        pinned = self.device.type == "cuda"  # page-locked, so that copies run at PCIe speed and asynchronously
        self._masters, self._copies, self._staging = [], [], []
        self._streamed: list[int] = []  # parameters whose staging buffer holds this backward's gradient
        with torch.no_grad():
            for (name, master_param), (copy_name, copy_param) in zip(
                master.named_parameters(), self.module.named_parameters(), strict=True
            ):
                if name != copy_name:
                    raise ValueError(f"the device copy's parameter {copy_name} does not match the master's {name}")
                if not master_param.requires_grad:
                    copy_param.copy_(master_param)
                    continue
                self._masters.append(master_param)
                self._copies.append(copy_param)
                staging = torch.empty(copy_param.shape, dtype=COPY_DTYPE, pin_memory=pinned)
                self._staging.append(staging)
                copy_param.register_post_accumulate_grad_hook(
                    partial(_stream_gradient, staging, self._streamed, len(self._copies) - 1)
                )
        self._synced: tuple | None = None  # the masters' write counters when the copy was last refreshed

    @property
    def autocast(self) -> Callable[[], contextlib.AbstractContextManager]:
        """bf16 autocast, whatever the device: it casts the fp32 boundary to the copy's dtype (and makes no second
        copy of weights already bf16)."""
        return lambda: torch.autocast(device_type=self.device.type, dtype=COPY_DTYPE)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def collect_gradients(self) -> None:
        """Add the gradients of the backward just run into the masters' fp32 ``.grad`` (the epoch's sum)."""
        self._synchronize()
        for index in self._streamed:
            master, staged = self._masters[index], self._staging[index]
            if master.grad is None:
                master.grad = staged.to(torch.float32)
            else:
                master.grad.add_(staged)
        self._streamed.clear()

    def discard_gradients(self) -> None:
        """Forget what a failed backward streamed: it never reaches the masters."""
        self._synchronize()
        self._streamed.clear()
        for copy in self._copies:
            copy.grad = None

    def _write_counters(self) -> tuple:
        return tuple((master._version, master.data_ptr()) for master in self._masters)

    @torch.no_grad()
    def refresh(self) -> bool:
        """Bring the copy up to the masters if they were written since the last refresh; True if it copied."""
        counters = self._write_counters()
        if counters == self._synced:
            return False
        for master, copy, staging in zip(self._masters, self._copies, self._staging, strict=True):
            staging.copy_(master)  # rounded to bf16 on the host: half the bytes cross PCIe
            copy.copy_(staging, non_blocking=True)
        self._synchronize()
        self._synced = counters
        return True

    def host_bytes(self) -> dict[str, int]:
        """What this layout holds on the host beside the masters' own weights: their gradient sum and the staging."""
        return {
            "gradient_sum": sum(m.grad.numel() * m.grad.element_size() for m in self._masters if m.grad is not None),
            "staging": sum(s.numel() * s.element_size() for s in self._staging),
        }

    def device_bytes(self) -> int:
        """What the copy holds on the device between requests: its weights and frozen tensors."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)


def _stream_gradient(staging: torch.Tensor, streamed: list[int], index: int, param: torch.Tensor) -> None:
    """A copy parameter's hook. It holds no reference to the DeviceCopy: torch keeps hooks where the garbage collector
    cannot see them, so one that did would keep the copy, and its weights on the device, alive after it is dropped
    (measured: 5.15 GiB of the 8b tail's left on an H200 once its worker had let go of it)."""
    # queued on the stream backward runs on: the allocator reuses the freed gradient only after the copy
    staging.copy_(param.grad, non_blocking=True)
    param.grad = None
    streamed.append(index)
