"""AdamW whose two moments can live in host memory, stepped chunk by chunk.

With ``offload=True`` exp_avg and exp_avg_sq sit in host RAM (pinned when the parameters are on a
GPU, so the copies run at full PCIe speed); each step moves at most ``chunk_numel`` elements of
each moment to the parameter's device, updates them there, and copies them back. The GPU never
holds a whole moment tensor. With ``offload=False`` the moments live beside the parameters and the
same arithmetic runs in place. Either way the update is torch's AdamW (decoupled weight decay),
and the state dict has AdamW's keys, so snapshots move between both settings.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from agora_client.config import RunConfig

DEFAULT_CHUNK_NUMEL = 1 << 22  # 16 MB of fp32 per moment chunk on the device


def _without_dynamo_guard(method: Callable[..., Any]) -> Callable[..., Any]:
    """The plain method under torch's ``_disable_dynamo`` wrapper, whose first call imports
    torch._dynamo: seconds of CPU at every worker start, in a process that never compiles."""
    return getattr(method, "__wrapped__", method)


class OffloadAdamW(torch.optim.Optimizer):
    add_param_group = _without_dynamo_guard(torch.optim.Optimizer.add_param_group)
    zero_grad = _without_dynamo_guard(torch.optim.Optimizer.zero_grad)
    state_dict = _without_dynamo_guard(torch.optim.Optimizer.state_dict)
    _base_load_state_dict = _without_dynamo_guard(torch.optim.Optimizer.load_state_dict)

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        offload: bool = True,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    ):
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be at least 1, got {chunk_numel}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.offload, self.chunk_numel = offload, chunk_numel

    def _moment_like(self, param: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """A zeroed (or copied from source) moment tensor where this optimizer keeps moments."""
        if not self.offload:
            moment = torch.zeros_like(param, memory_format=torch.contiguous_format)
        else:
            pin = param.is_cuda and torch.cuda.is_available()
            moment = torch.zeros(param.shape, dtype=param.dtype, device="cpu", pin_memory=pin)
        if source is not None:
            if tuple(source.shape) != tuple(param.shape):
                raise ValueError(
                    f"optimizer state of shape {tuple(source.shape)} does not fit a parameter of shape "
                    f"{tuple(param.shape)}"
                )
            moment.copy_(source)
        return moment

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = self._moment_like(param)
            state["exp_avg_sq"] = self._moment_like(param)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("OffloadAdamW does not support sparse gradients")
                state = self._state_of(param)
                state["step"] += 1
                self._update(param, state, group)
        return loss

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = state["step"]
        step_size = lr / (1 - beta1**step)
        correction2_sqrt = math.sqrt(1 - beta2**step)
        flat_param, flat_grad = param.view(-1), param.grad.reshape(-1)
        flat_avg, flat_avg_sq = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        for start in range(0, flat_param.numel(), self.chunk_numel):
            window = slice(start, start + self.chunk_numel)
            # on the parameter's device: a view when the moments already live there, else one chunk's copy
            avg = flat_avg[window].to(param.device, non_blocking=True)
            avg_sq = flat_avg_sq[window].to(param.device, non_blocking=True)
            chunk, grad = flat_param[window], flat_grad[window]
            chunk.mul_(1 - lr * decay)
            avg.lerp_(grad, 1 - beta1)
            avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            chunk.addcdiv_(avg, (avg_sq.sqrt() / correction2_sqrt).add_(eps), value=-step_size)
            if avg.device != flat_avg.device:
                flat_avg[window].copy_(avg)  # blocking: the next chunk may reuse this device memory
                flat_avg_sq[window].copy_(avg_sq)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load AdamW-shaped state; the moments go straight to where this optimizer keeps them.

        torch's version would first cast every moment to its parameter's device, i.e. copy all of
        them to the GPU at once, the memory that offloading saves.
        """
        saved_state = state_dict.get("state", {})
        self._base_load_state_dict({**state_dict, "state": {}})  # checks the groups, restores hyperparameters
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for index, param in zip(saved_ids, params, strict=True):
            entry = saved_state.get(index)
            if not entry:
                continue
            missing = {"step", "exp_avg", "exp_avg_sq"} - entry.keys()
            if missing:
                raise ValueError(f"optimizer state for parameter {index} lacks {', '.join(sorted(missing))}")
            self.state[param] = {
                "step": int(entry["step"]),
                "exp_avg": self._moment_like(param, entry["exp_avg"]),
                "exp_avg_sq": self._moment_like(param, entry["exp_avg_sq"]),
            }


def build_optimizer(parameters: list[torch.nn.Parameter], config: RunConfig) -> OffloadAdamW:
    """The stage optimizer of a run config: its AdamW hyperparameters and its offload switch."""
    optim = config.optim
    return OffloadAdamW(
        parameters, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, offload=config.offload_optimizer
    )
