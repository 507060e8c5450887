"""The stage's hivemind ModuleBackend: forward without a graph, backward by recomputation.

Activations cross the process boundary detached, so on backward the worker re-runs its forward
on the resent input to rebuild the autograd graph (hivemind's ModuleBackend.backward does exactly
that), then returns only the gradient with respect to the input. Parameter gradients stay here
and are consumed by the stage's own optimizer at the next stage epoch.

Inputs reaching the backend are finite (the connection handler checked them), so outputs or input
gradients that are not finite mean this worker's own weights are broken: it reports itself unhealthy
and fails the batch rather than hand the numbers on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from hivemind.moe.server.module_backend import ModuleBackend

from agora_client.model.layers import autocast_context

if TYPE_CHECKING:
    from agora_client.serving.device_copy import DeviceCopy


class WorkerUnhealthy(RuntimeError):
    """This worker is out of routing (its own outputs turned non-finite); callers should go elsewhere."""

    MESSAGE = (
        "this worker is not ready: its outputs turned non-finite and it is reloading a peer's state; "
        "send the request to another worker of the stage"
    )


class WorkerYielding(RuntimeError):
    """This worker gave the GPU back to its owner for now; callers should go elsewhere."""

    # "not ready" is what trainers read as: send it elsewhere (trainer/errors.py)
    MESSAGE = (
        "this worker is not ready: it yields its GPU to the owner for now; send the request to another worker of "
        "the stage"
    )


class StageBackend(ModuleBackend):
    """A stage served to trainers: requests run under ``lock`` (held by the training loop while it changes the
    parameters), and every backward reports its sample count to ``on_samples`` (the stage's epoch counter).
    ``longest_lock_wait_s`` is the longest any request waited for the lock. With ``device_copy`` (the offload
    layout) ``module`` is its bf16 copy: refreshed from the masters before each request, its gradients summed
    into the masters' after each backward."""

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        *,
        lock: threading.Lock,
        on_samples: Callable[[int], None],
        device: torch.device,
        mixed_precision: bool,
        on_forward: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], None],
        on_backward: Callable[[torch.Tensor], None],
        on_unhealthy: Callable[[str], None],
        device_copy: DeviceCopy | None = None,
        **kwargs,
    ):
        if device_copy is not None and module is not device_copy.module:
            raise ValueError("with a device copy, the backend serves the copy's module")
        super().__init__(name, module, **kwargs)
        self.lock, self._on_samples, self._device_copy = lock, on_samples, device_copy
        self._autocast = autocast_context(device, mixed_precision) if device_copy is None else device_copy.autocast
        self._on_forward, self._on_backward, self._on_unhealthy = on_forward, on_backward, on_unhealthy
        self.longest_lock_wait_s = 0.0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        asked = time.monotonic()
        with self.lock:
            self.longest_lock_wait_s = max(self.longest_lock_wait_s, time.monotonic() - asked)
            if self._device_copy is not None:
                self._device_copy.refresh()
            yield

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self._locked(), self._autocast():
            outputs = super().forward(*inputs)
        outputs = tuple(out.float() if out.is_floating_point() else out for out in outputs)
        self._require_finite(outputs, "forward outputs")
        self._on_forward(_tokens(inputs), outputs)
        return outputs

    def backward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with self._locked(), self._autocast(), self._discarding_on_failure():
            grads = super().backward(*inputs)  # re-runs forward, autograd, then calls on_backward
        grads = tuple(grad.float() if grad.is_floating_point() else grad for grad in grads)
        self._require_finite(grads, "input gradients")
        self._on_backward(_tokens(inputs))
        return grads

    def _require_finite(self, tensors: tuple[torch.Tensor, ...], what: str) -> None:
        if not all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()):
            self._on_unhealthy(f"its {what} turned non-finite on finite inputs")
            raise WorkerUnhealthy(WorkerUnhealthy.MESSAGE)

    @contextlib.contextmanager
    def _discarding_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if self._device_copy is not None:
                self._device_copy.discard_gradients()
            raise

    def on_backward(self, batch_size: int) -> None:
        # Replaces hivemind's per-request optimizer step: gradients accumulate until the stage epoch.
        if self._device_copy is not None:
            self._device_copy.collect_gradients()
        self._on_samples(batch_size)


def _tokens(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Every stage receives the token ids (the head as its only input, the others after the boundary)."""
    return next(tensor for tensor in inputs if not tensor.is_floating_point())
