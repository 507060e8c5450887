"""The stage's hivemind ModuleBackend: forward without a graph, backward by recomputation.

Activations cross the process boundary detached, so on backward the worker re-runs its forward
on the resent input to rebuild the autograd graph (hivemind's ModuleBackend.backward does exactly
that), then returns only the gradient with respect to the input. Parameter gradients stay here
and are consumed by the stage's own optimizer at the next stage epoch.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from hivemind.moe.server.module_backend import ModuleBackend

from agora_client.worker.epochs import EpochController


def autocast_context(device: torch.device, mixed_precision: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast when the run asks for mixed precision, on the CPU too; parameters and grads stay fp32.

    A GPU without native bf16 (compute capability < 8.0) would emulate it slower than fp32: it runs fp32
    (contributors with such cards are refused at join, see agora_client/model/memory.py).
    """
    if not mixed_precision or (device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)):
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class StageBackend(ModuleBackend):
    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        *,
        epochs: EpochController,
        device: torch.device,
        mixed_precision: bool,
        on_forward: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], None],
        on_backward: Callable[[torch.Tensor], None],
        slowdown_s: float = 0.0,
        **kwargs,
    ):
        super().__init__(name, module, **kwargs)
        self.epochs, self.slowdown_s = epochs, slowdown_s
        self._autocast = autocast_context(device, mixed_precision)
        self._on_forward, self._on_backward = on_forward, on_backward

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self.epochs.lock, self._autocast():
            outputs = super().forward(*inputs)
        outputs = tuple(out.float() if out.is_floating_point() else out for out in outputs)
        time.sleep(self.slowdown_s)  # emulates a slower GPU in tests and benchmarks (0 by default)
        self._on_forward(_tokens(inputs), outputs)
        return outputs

    def backward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self.epochs.lock, self._autocast():
            grads = super().backward(*inputs)  # re-runs forward, autograd, then calls on_backward
        time.sleep(self.slowdown_s)
        self._on_backward(_tokens(inputs))
        return tuple(grad.float() if grad.is_floating_point() else grad for grad in grads)

    def on_backward(self, batch_size: int) -> None:
        # Replaces hivemind's per-request optimizer step: gradients accumulate until the stage epoch.
        self.epochs.on_samples(batch_size)


def _tokens(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Every stage receives the token ids (the head as its only input, the others after the boundary)."""
    return next(tensor for tensor in inputs if not tensor.is_floating_point())
