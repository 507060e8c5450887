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


def autocast_context(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """bf16 autocast on GPUs with native bf16 (compute capability >= 8.0); plain fp32 elsewhere."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


class StageBackend(ModuleBackend):
    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        *,
        epochs: EpochController,
        device: torch.device,
        on_forward: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], None],
        on_backward: Callable[[torch.Tensor], None],
        slowdown_s: float = 0.0,
        lie: bool = False,
        **kwargs,
    ):
        super().__init__(name, module, **kwargs)
        self.epochs, self.slowdown_s, self.lie = epochs, slowdown_s, lie
        self._autocast = autocast_context(device)
        self._on_forward, self._on_backward = on_forward, on_backward

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self.epochs.lock, self._autocast():
            outputs = super().forward(*inputs)
        outputs = tuple(out.float() if out.is_floating_point() else out for out in outputs)
        time.sleep(self.slowdown_s)  # emulates a slower GPU in tests and benchmarks (0 by default)
        self._on_forward(_tokens(inputs), outputs)
        return _scrambled(outputs) if self.lie else outputs

    def backward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self.epochs.lock, self._autocast():
            grads = super().backward(*inputs)  # re-runs forward, autograd, then calls on_backward
        time.sleep(self.slowdown_s)
        self._on_backward(_tokens(inputs))
        grads = tuple(grad.float() if grad.is_floating_point() else grad for grad in grads)
        return _scrambled(grads) if self.lie else grads

    def on_backward(self, batch_size: int) -> None:
        # Replaces hivemind's per-request optimizer step: gradients accumulate until the stage epoch.
        self.epochs.on_samples(batch_size)


def _scrambled(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Test-only lying worker: random values of the right shape and scale in place of every float output."""
    return tuple(
        torch.randn_like(t) * t.pow(2).mean().sqrt() if t.is_floating_point() and t.numel() else t for t in tensors
    )


def _tokens(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Every stage receives the token ids (the head as its only input, the others after the boundary)."""
    return next(tensor for tensor in inputs if not tensor.is_floating_point())
