"""The offload layout (model/memory.py LAYOUTS, serving/device_copy.py): its bytes against the plan, its numerics
against the fp32 layout, and snapshots and checkpoints that move between the two (an old-layout checkpoint loads,
trains and exports). Sizes are small: bf16 matmuls are emulated, and slow, on a CPU without native bf16."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from agora_client.checkpoints import run_record, select_set
from agora_client.checkpoints.export import export_set
from agora_client.config import load_config
from agora_client.model import build_stage
from agora_client.model.memory import plan_stage
from agora_client.serving.backend import StageBackend
from agora_client.serving.device_copy import DeviceCopy
from agora_client.snapshots import LocalStore, load_stage_snapshot
from agora_client.worker import prepared_stage
from agora_client.worker.optimizer import build_optimizer
from agora_client.worker.prepared_stage import prepare_stage
from tests.test_checkpoints import T0, save
from tests.test_export_sharded import tensors

CPU = torch.device("cpu")
SHORT = {"model": {"seq_len": 32}}  # tiny at 32 tokens
# the 8b layer split (6-layer tail; lm_head a third of its parameters, as at 8b) at width 128 and 16 tokens
SCALED_TAIL = {
    "model": {"d_model": 128, "n_heads": 1, "n_kv_heads": 1, "ffn_hidden": 460, "vocab_size": 8016, "seq_len": 16}
}


class Worker:
    """A tail's module, optimizer and backend as WorkerNode wires them, in either layout."""

    def __init__(self, run, layout: str, seed: int = 0):
        self.master = build_stage(run.model, "tail", seed=seed)
        self.parameters = [p for p in self.master.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.parameters, run)
        self.copy = DeviceCopy(self.master, run.model, CPU, seed=seed) if layout == "offload" else None
        module = self.master if self.copy is None else self.copy.module
        example = self.master.example_inputs(2)
        self.samples = 0
        self.backend = StageBackend(
            "tail.0.0",
            module,
            device_copy=self.copy,
            lock=threading.Lock(),
            on_samples=self._count,
            device=CPU,
            mixed_precision=True,
            on_forward=lambda tokens, outputs: None,
            on_backward=lambda tokens: None,
            on_unhealthy=lambda reason: None,
            args_schema=tuple(BatchTensorDescriptor.from_tensor(t) for t in example),
            outputs_schema=BatchTensorDescriptor.from_tensor(torch.zeros(2)),
            min_batch_size=1,
            max_batch_size=4,
        )

    def _count(self, samples: int) -> None:
        self.samples += samples

    def backward(self, boundary: torch.Tensor, tokens: torch.Tensor) -> None:
        self.backend.backward(boundary, tokens, tokens, torch.ones(boundary.shape[0]))

    def loss(self, boundary: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(boundary, tokens, tokens)[0]

    def step(self) -> None:  # what EpochController._step does, less the clipping
        for parameter in self.parameters:
            parameter.grad.div_(self.samples)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples = 0


def _batches(run, count: int, size: int = 2, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    shape = (size, run.model.seq_len)
    width = run.model.subspace_rank if run.model.subspace.enabled else run.model.d_model
    return [
        (
            torch.randn(*shape, width, generator=generator),
            torch.randint(0, run.model.vocab_size, shape, generator=generator),
        )
        for _ in range(count)
    ]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_scaled_8b_tail_holds_what_the_plan_says_on_each_side():
    run = load_config("8b", SCALED_TAIL)
    worker = Worker(run, "offload")
    for boundary, tokens in _batches(run, 1, size=1):
        worker.backward(boundary, tokens)
    worker.step()  # the moments exist from here on
    for boundary, tokens in _batches(run, 1, size=1, seed=2):
        worker.backward(boundary, tokens)  # and the gradient sum is alive again
    plan = plan_stage(run, "tail", 1, layout="offload")
    device_side = worker.copy.device_bytes()
    assert abs(device_side / plan.gpu_resident - 1) < 0.1, (device_side, plan.gpu_resident)
    assert all(p.dtype == torch.bfloat16 for p in worker.copy.module.parameters())
    moments = [t for state in worker.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    held = worker.copy.host_bytes()
    host_side = _nbytes(worker.parameters) + held["gradient_sum"] + held["staging"] + _nbytes(moments)
    planned_host = plan.host - plan.averaging  # SPARTA's buffers belong to its averager, not built here
    assert abs(host_side / planned_host - 1) < 0.1, (host_side, planned_host)
    assert held["gradient_sum"] == plan.gradient_sum and held["staging"] == plan.staging


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_offload_layout_trains_like_the_fp32_layout_within_bf16_rounding():
    """Same weights, same batches, 2 AdamW steps of 2 microbatches each (the gradient sum adds across them).

    The bounds: the offload layout's forward and backward read weights rounded to bf16 (relative error 2^-9) and
    run in bf16, so its losses may differ by a few 2^-9 relative, and each gradient tensor, a sum over tokens of
    bf16 products, by a few percent in relative L2 (measured: 0.2-2.5%; a dropped microbatch or a stale copy is tens
    of percent). AdamW's step is m / sqrt(v) times lr, about lr whatever the gradient's size, so gradients that
    differ by rounding move a weight by at most about 2 lr per step apart (a sign flipped); on average far less. The
    fp32 layout runs fp32 on a CPU without native bf16 and bf16 autocast elsewhere; either way the masters, the
    gradient sum and the moments are fp32.
    """
    run = load_config("tiny", SHORT)
    fp32, offload = Worker(run, "fp32"), Worker(run, "offload")
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    gate = offload.copy.module.layers[str(run.model.n_layers - 1)].mlp.gate_proj
    gate.register_forward_hook(lambda module, args, output: seen.append((module.weight.dtype, output.dtype)))
    steps, lr = 2, run.optim.lr
    probe = _batches(run, 1, seed=9)[0]
    for step in range(steps):
        for boundary, tokens in _batches(run, 2, seed=10 + step):
            fp32.backward(boundary, tokens)
            offload.backward(boundary, tokens)
        for master_a, master_b in zip(fp32.parameters, offload.parameters, strict=True):
            assert master_b.grad.dtype == torch.float32
            assert _relative(master_b.grad, master_a.grad) < 2**-4, (step, master_a.shape)
        fp32.step()
        offload.step()
        loss_a, loss_b = fp32.loss(*probe), offload.loss(*probe)
        assert torch.allclose(loss_a, loss_b, rtol=8 * 2**-9), (step, loss_a, loss_b)
    assert seen and all(dtypes == (torch.bfloat16, torch.bfloat16) for dtypes in seen)  # the bf16 path really ran
    differences = torch.cat(
        [(a - b).detach().abs().flatten() for a, b in zip(fp32.parameters, offload.parameters, strict=True)]
    )
    assert all(p.dtype == torch.float32 for p in offload.parameters)
    assert float(differences.max()) <= 2 * steps * lr
    assert float(differences.mean()) <= 0.1 * steps * lr
    moved = torch.cat([p.detach().flatten() for p in fp32.parameters]) - torch.cat(
        [p.detach().flatten() for p in build_stage(run.model, "tail", seed=0).parameters()]
    )
    assert float(moved.abs().mean()) > 5 * float(differences.mean())  # training moved them far more than they differ


def test_a_checkpoint_of_the_fp32_layout_loads_trains_saves_and_exports_in_the_offload_layout(tmp_path: Path):
    run = load_config("tiny", SHORT)
    store, record = LocalStore(tmp_path / "store"), {"run": run_record(run)}
    for index, stage in enumerate(run.model.stage_names[:-1]):
        save(store, stage, T0, seed=index, config=run)
    before = Worker(run, "fp32", seed=3)
    for boundary, tokens in _batches(run, 1):
        before.backward(boundary, tokens)
    before.step()  # the moments exist: the checkpoint holds them
    old = store.save("tail", before.master, before.optimizer, 1, extra=record, timestamp=T0)
    after = Worker(run, "offload", seed=4)  # other weights until the checkpoint sets them
    assert load_stage_snapshot(store.path(old), after.master, after.optimizer, stage="tail").epoch == 1
    probe = _batches(run, 1, seed=5)[0]
    assert torch.allclose(after.loss(*probe), before.loss(*probe), rtol=8 * 2**-9)  # the copy took the loaded weights
    after.backward(*probe)
    after.step()
    new = store.save("tail", after.master, after.optimizer, 2, extra=record, timestamp=T0 + 60)
    reader = Worker(run, "fp32", seed=5)
    assert load_stage_snapshot(store.path(new), reader.master, reader.optimizer, stage="tail").epoch == 2
    for saved, master in zip(reader.parameters, after.parameters, strict=True):
        assert torch.equal(saved, master)  # the masters, unchanged in format
    assert not torch.equal(reader.parameters[-1], before.parameters[-1])  # and the step in the offload layout counted
    chosen = select_set(store)
    assert chosen.members["tail"] == new
    exported = tensors(export_set(store, chosen, tmp_path / "hf"))
    last = f"model.layers.{run.model.n_layers - 1}"
    trained = after.master
    assert torch.equal(exported["lm_head.weight"], trained.lm_head.weight)
    assert torch.equal(
        exported[f"{last}.mlp.gate_proj.weight"], trained.layers[str(run.model.n_layers - 1)].mlp.gate_proj.weight
    )


def test_a_failed_backward_leaves_the_gradient_sum_alone():
    run = load_config("tiny", SHORT)
    worker = Worker(run, "offload")
    boundary, tokens = _batches(run, 1)[0]
    worker.backward(boundary, tokens)
    summed = [p.grad.clone() for p in worker.parameters]
    with pytest.raises(Exception):  # noqa: B017 (whatever hivemind raises for it)
        worker.backend.backward(boundary, tokens, tokens, torch.ones(3))  # a gradient of the wrong batch size
    assert all(torch.equal(p.grad, s) for p, s in zip(worker.parameters, summed, strict=True))
    assert all(p.grad is None for p in worker.copy.module.parameters())


def test_a_dropped_device_copy_is_freed_with_its_weights():
    """A worker that lets go of its stage (it leaves, or takes another) gives the copy's device memory back: on an
    H200 the 8b tail's copy stayed, 5.15 GiB, while its gradient hooks referred to it."""
    run = load_config("tiny", SHORT)
    worker = Worker(run, "offload")
    boundary, tokens = _batches(run, 1)[0]
    worker.backward(boundary, tokens)  # the hooks have run
    copy, weights = weakref.ref(worker.copy), weakref.ref(next(worker.copy.module.parameters()))
    del worker
    gc.collect()
    assert copy() is None and weights() is None


def test_preparing_a_stage_in_the_offload_layout_runs_no_forward_on_the_host_masters(monkeypatch):
    """The schema comes from a meta run: a host forward would take minutes at 8b and hold unplanned activations."""
    run = load_config("tiny", SHORT)
    host_forwards = []
    real_build = prepared_stage.build_stage

    def counting_build(*args, device, **kwargs):
        module = real_build(*args, device=device, **kwargs)
        if device.type != "meta":
            module.register_forward_hook(lambda *_: host_forwards.append(torch.is_grad_enabled()))
        return module

    monkeypatch.setattr(prepared_stage, "build_stage", counting_build)
    for stage in ("head", "body1", "tail"):
        fp32 = prepare_stage(run, stage, CPU, seed=0, seeded_weights=True)
        offload = prepare_stage(run, stage, CPU, seed=0, seeded_weights=True, layout="offload")
        assert offload.args_schema == fp32.args_schema and offload.outputs_schema == fp32.outputs_schema
        assert next(offload.module.parameters()).device == CPU
    # the three fp32 warm-ups, none in the offload layout; without autograd, so they keep no activations (at 8b,
    # with autograd and in fp32, the head's warm-up held 33 GiB on an H200)
    assert host_forwards == [False, False, False]
