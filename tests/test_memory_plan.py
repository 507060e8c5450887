"""The 8b shapes, the memory plan against the tensors stages really build, the join-time GPU fit check, and the
preflight's use of both."""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from agora_client import describe
from agora_client.auth.client import StageAssignment
from agora_client.auth.run_description import TokenizerSummary, describe_run
from agora_client.config import ConfigError, load_config
from agora_client.events import EventWriter
from agora_client.frontend.lines import human_bytes
from agora_client.joining import gpu_fit
from agora_client.joining.gpu_fit import GpuRefused, HostRefused, JoinFit, check_capability, check_host, fit_stage
from agora_client.joining.preflight import check_disk, check_gpu, check_host_ram
from agora_client.model import build_stage, param_counts
from agora_client.model.memory import (
    CUDA_RESERVED_BYTES,
    largest_microbatch,
    plan_stage,
    saved_activation_bytes,
    usable_bytes,
)
from agora_client.system.gpu import GpuSpec
from agora_client.worker.optimizer import OffloadAdamW

GB = 10**9
GIB = 2**30


def test_8b_stages_reproduce_the_documents_counts() -> None:
    counts = param_counts(load_config("8b").model)
    documented = {"head": 1.37e9, "tail": 2.73e9, **{f"body{i}": 907e6 for i in range(1, 6)}}
    assert counts.keys() == documented.keys()
    for stage, count in counts.items():
        assert abs(count / documented[stage] - 1) < 0.005, (stage, count)


def test_8b_shapes_follow_the_production_run() -> None:
    config = load_config("8b").model
    assert (config.d_model, config.n_heads, config.kv_heads, config.head_dim) == (5120, 40, 8, 128)
    llama_rule = math.ceil(4 * config.d_model * 2 / 3 * 1.3 / 1024) * 1024  # multiplier 1.3, multiple of 1024
    assert config.ffn_hidden == llama_rule == 18432
    assert (config.vocab_size, config.seq_len, config.subspace_rank) == (128256, 4096, 51)
    assert [spec.layers for spec in config.stages] == [6, 4, 4, 4, 4, 4, 6]


def test_grouped_query_attention_keeps_the_olmo2_parameter_layout() -> None:
    config = load_config("tiny", {"model": {"n_kv_heads": 2}}).model
    block = build_stage(config, "body1", seed=0, device="meta").layers["1"]
    d, kv = config.d_model, config.kv_width
    assert kv == 2 * config.head_dim
    assert block.attn.q_proj.weight.shape == (d, d) and block.attn.k_proj.weight.shape == (kv, d)
    assert block.attn.v_proj.weight.shape == (kv, d) and block.attn.q_norm.weight.shape == (d,)
    assert block.attn.k_norm.weight.shape == (kv,)
    with pytest.raises(ConfigError, match="multiple of model.n_kv_heads"):
        load_config("tiny", {"model": {"n_kv_heads": 3}})


@pytest.mark.parametrize("mixed", [True, False], ids=["bf16", "fp32"])
def test_8b_plan_equals_the_tensors_each_stage_builds_on_meta(mixed: bool) -> None:
    run = load_config("8b", {"use_mixed_precision": mixed, "offload_optimizer": False})
    for stage in run.model.stage_names:
        module = build_stage(run.model, stage, seed=0, device="meta")
        plan = plan_stage(run, stage, 1)
        assert plan.weights == sum(p.numel() * p.element_size() for p in module.parameters())
        assert plan.frozen == sum(b.numel() * b.element_size() for b in module.buffers())
        module(*module.example_inputs(1)).sum().backward()  # real gradients, on meta
        assert plan.gradients == sum(p.grad.numel() * p.grad.element_size() for p in module.parameters())
        optimizer = OffloadAdamW(list(module.parameters()), offload=False)
        optimizer.step()  # creates the moments, on meta
        moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        assert plan.moments == sum(t.numel() * t.element_size() for t in moments)
        assert plan.gpu_resident == plan.weights + plan.gradients + plan.frozen + plan.moments


def _saved_bytes(config, stage: str, batch: int, mixed: bool) -> int:
    """Bytes autograd really keeps for backward: unique storages of saved tensors, parameters and buffers excluded."""
    module = build_stage(config, stage, seed=0)
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)
    boundary = torch.randn(batch, config.seq_len, module.boundary_width, generator=generator, requires_grad=True)
    inputs = {"head": (tokens,), "tail": (boundary, tokens, tokens)}.get(stage, (boundary, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            module(*inputs)
    return sum(saved.values())


@pytest.mark.parametrize(
    "overrides", [{"n_kv_heads": 2}, {"subspace": {"enabled": False}}], ids=["gqa-subspace", "dense"]
)
@pytest.mark.parametrize("mixed", [True, False], ids=["bf16", "fp32"])
def test_planned_saved_activations_equal_what_autograd_keeps(overrides: dict, mixed: bool) -> None:
    # The attention kernel decides what attention saves: measured on the CPU's real kernels
    # (the meta device would run the math kernel with its [T x T] matrices instead).
    config = load_config("tiny", {"model": {"seq_len": 16, **overrides}}).model
    for stage in ("head", "body1", "tail"):
        assert saved_activation_bytes(config, stage, 3, mixed_precision=mixed) == _saved_bytes(config, stage, 3, mixed)


def test_offload_moves_the_moments_to_the_host() -> None:
    on = plan_stage(load_config("8b"), "body1")
    off = plan_stage(load_config("8b", {"offload_optimizer": False}), "body1")
    assert on.host == on.moments + on.averaging and off.host == off.averaging
    assert off.gpu_resident - on.gpu_resident == on.moments == 2 * on.weights


@pytest.mark.parametrize("payload", ["bf16", "int8"])
def test_a_compressed_payload_keeps_its_residuals_on_the_host(payload: str) -> None:
    fp32 = plan_stage(load_config("8b", {"sparta": {"payload": "fp32"}}), "body1")
    compressed = plan_stage(load_config("8b", {"sparta": {"payload": payload}}), "body1")
    slice_bytes = fp32.averaging // 2
    # one float32 residual per trainable parameter, and three more slices while a round is applied
    assert compressed.averaging - fp32.averaging == compressed.weights + 3 * slice_bytes
    assert compressed.host - fp32.host == compressed.averaging - fp32.averaging
    assert compressed.gpu_peak == fp32.gpu_peak


@pytest.mark.parametrize("sparta, floats", [({"outer_momentum": 0.9, "outer_lr": 0.7}, 2), ({"outer_lr": 0.7}, 1)])
def test_an_outer_step_keeps_its_anchors_and_momenta_on_the_host(sparta: dict, floats: int) -> None:
    plain = plan_stage(load_config("8b", {"sparta": {"payload": "fp32"}}), "body1")
    outer = plan_stage(load_config("8b", {"sparta": {**sparta, "payload": "fp32"}}), "body1")
    slice_bytes = plain.averaging // 2
    # an anchor per trainable parameter, a momentum more when there is momentum, and the slice a step computes on
    assert outer.averaging - plain.averaging == floats * outer.weights + slice_bytes
    assert outer.host - plain.host == outer.averaging - plain.averaging
    assert outer.gpu_peak == plain.gpu_peak
    no_outer_step = {"outer_momentum": 0.0, "outer_lr": 1.0, "payload": "fp32"}
    assert plan_stage(load_config("8b", {"sparta": no_outer_step}), "body1") == plain


def _card(gib: float, capability: tuple[int, int] = (8, 9), name: str = "test card") -> GpuSpec:
    return GpuSpec(name, int(gib * GIB), capability)


@pytest.mark.parametrize("vram_gb", [20, 24, 42, 54, 64, 78, 80])
def test_microbatch_picked_for_each_card_follows_the_plan(vram_gb: int) -> None:
    run = load_config("8b")
    card = GpuSpec("card", vram_gb * GB, (8, 6))
    for stage in ("head", "body1"):
        picked = largest_microbatch(run, stage, card.memory_total)
        if picked:
            assert plan_stage(run, stage, picked).gpu_peak <= usable_bytes(card.memory_total)
            assert fit_stage(run, stage, card).microbatch == picked
        assert plan_stage(run, stage, picked + 1).gpu_peak > usable_bytes(card.memory_total)


def test_a_gpu_too_small_for_the_stage_is_refused_with_the_numbers() -> None:
    run = load_config("8b")
    needed = plan_stage(run, "tail", 1, layout="offload").gpu_peak  # the layout that holds the most
    with pytest.raises(GpuRefused) as refused:
        fit_stage(run, "tail", _card(16))
    message = str(refused.value)
    assert "cannot hold stage tail" in message and f"{needed / GIB:.2f} GiB" in message and "16.00 GiB" in message
    # just enough memory is accepted, in the offload layout; the fp32 layout's peak takes the fp32 layout
    decision = fit_stage(run, "tail", GpuSpec("home", needed + CUDA_RESERVED_BYTES, (8, 9)))
    assert (decision.microbatch, decision.layout) == (1, "offload")
    fp32 = plan_stage(run, "tail", 1).gpu_peak
    assert fit_stage(run, "tail", GpuSpec("big", fp32 + CUDA_RESERVED_BYTES, (9, 0))).layout == "fp32"


def test_the_8b_tail_fits_a_24_gib_card_and_a_contributors_host() -> None:
    run = load_config("8b")
    layout = fit_stage(run, "tail", _card(24)).layout
    plan = plan_stage(run, "tail", 1, layout=layout)  # at one sequence of 4,096 tokens
    assert layout == "offload" and plan.gpu_peak <= 22.5 * GIB
    assert plan.host_need(True) <= 80 * GB
    for stage in ("head", "body1"):  # where the fp32 layout fits, nothing changes
        assert fit_stage(run, stage, _card(24)).layout == "fp32"


def test_compute_capability_below_8_is_refused_with_the_reason() -> None:
    for capability in ((7, 0), (7, 5)):
        with pytest.raises(GpuRefused, match=r"compute capability 7\.\d; workers need 8\.0 .* BF16"):
            fit_stage(load_config("8b"), "body1", _card(80, capability, "Tesla V100"))
    assert fit_stage(load_config("8b"), "body1", _card(80, (8, 0))).microbatch >= 1


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (8, 0), (9, 0)])
def test_preflight_applies_the_fit_checks_capability_rule(monkeypatch: pytest.MonkeyPatch, capability) -> None:
    """The preflight fails the card the fit check would refuse, with the same reason, before anything else runs."""
    card = _card(80, capability, "card")
    properties = SimpleNamespace(
        name=card.name, total_memory=card.memory_total, major=capability[0], minor=capability[1]
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    result = check_gpu("cuda:0", "GPU 0 is cuda:0")
    if capability < (8, 0):
        with pytest.raises(GpuRefused) as refused:
            check_capability(card)
        assert (result.status, result.reason) == ("fail", str(refused.value))
    else:
        check_capability(card)
        assert (result.status, result.reason) == ("pass", "GPU 0 is cuda:0")


def test_preflight_needs_come_from_the_plan_of_the_smallest_stage(tmp_path: Path) -> None:
    """Before its stage is assigned, a joiner is refused only if it cannot hold even the smallest stage."""
    config = load_config("8b")
    llama3 = TokenizerSummary(
        "0" * 64, config.model.vocab_size, config.tokenizer.eos_token
    )  # offline: not fetched from the hub
    run = describe_run(config, (), None, None, llama3)
    plans = [plan_stage(run.config, stage) for stage in run.config.model.stage_names]
    smallest = min(plans, key=lambda plan: plan.snapshot)
    assert smallest.stage.startswith("body") and smallest.snapshot == 12 * min(param_counts(run.config.model).values())
    assert f"about {human_bytes(smallest.disk_need)} needed" in check_disk(run, tmp_path).value
    assert f"about {human_bytes(smallest.host)} needed" in check_host_ram(run, on_cpu=False).value
    on_cpu = smallest.host + smallest.gpu_peak  # a CPU worker holds the whole stage in host memory
    assert f"about {human_bytes(on_cpu)} needed" in check_host_ram(run, on_cpu=True).value


def test_preflight_ram_need_on_a_gpu_follows_the_layout_the_card_takes() -> None:
    """On a 12 GiB card the 8b bodies fit only in the offload layout, whose fp32 masters, gradient sum and staging sit
    in host RAM: the preflight asks for that, not for the fp32 body's smaller need; on a 24 GiB card the fp32 one."""
    config = load_config("8b")
    summary = TokenizerSummary("0" * 64, config.model.vocab_size, config.tokenizer.eos_token)
    run = describe_run(config, (), None, None, summary)
    fp32_body, offload_body = plan_stage(config, "body1"), plan_stage(config, "body1", layout="offload")
    assert offload_body.host > fp32_body.host  # 19.4 GiB against 11.0 GiB
    assert f"about {human_bytes(offload_body.host)} needed" in check_host_ram(run, False, gpu_memory=12 * GIB).value
    assert f"about {human_bytes(fp32_body.host)} needed" in check_host_ram(run, False, gpu_memory=24 * GIB).value


def test_a_16_gb_host_is_admitted_for_a_body_and_refused_for_the_tail_with_the_numbers() -> None:
    run, host = load_config("8b"), 16 * GB
    body, tail = plan_stage(run, "body1"), plan_stage(run, "tail")
    assert body.host < host < tail.host  # 11.0 GiB planned against 33.1 GiB
    check_host(run, "body1", on_gpu=True, ram_available=host, disk_free=body.disk_need)
    with pytest.raises(HostRefused) as refused:
        check_host(run, "tail", on_gpu=True, ram_available=host, disk_free=tail.disk_need)
    assert f"keeps {tail.host / GIB:.2f} GiB in host memory" in str(refused.value)
    assert f"has {host / GIB:.2f} GiB available" in str(refused.value)
    with pytest.raises(HostRefused, match=rf"needs {body.disk_need / GIB:.2f} GiB of disk"):
        check_host(run, "body1", on_gpu=True, ram_available=host, disk_free=body.disk_need - 1)


def test_the_fit_plans_with_the_cards_free_memory_and_an_explicit_capacity() -> None:
    run = load_config("8b")
    idle, busy = _card(48), GpuSpec("desktop card", 48 * GIB, (8, 9), memory_free=26 * GIB)
    assert busy.capacity == 26 * GIB
    assert (
        fit_stage(run, "body1", busy).largest
        == largest_microbatch(run, "body1", 26 * GIB)
        < fit_stage(run, "body1", idle).largest
    )
    held = idle.limited_to(24 * GIB)  # a 48 GB card held to half by a torch memory fraction is judged as a 24 GB one
    assert fit_stage(run, "body1", held).largest == fit_stage(run, "body1", _card(24)).largest
    with pytest.raises(GpuRefused, match=r"48\.00 GiB \(12\.00 GiB free\)"):
        fit_stage(run, "tail", GpuSpec("desktop card", 48 * GIB, (8, 9), memory_free=12 * GIB))


def test_batch_size_override_may_only_lower_the_microbatch() -> None:
    run = load_config("8b")
    largest = fit_stage(run, "body1", _card(48)).largest
    assert largest > 2
    assert fit_stage(run, "body1", _card(48), override=2).microbatch == 2
    for bad in (0, largest + 1):
        with pytest.raises(GpuRefused, match="may only lower"):
            fit_stage(run, "body1", _card(48), override=bad)


def test_join_check_refuses_before_the_download_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * GB)
    )  # a host that holds any stage
    monkeypatch.setattr(
        gpu_fit.shutil, "disk_usage", lambda path: SimpleNamespace(free=256 * GB)
    )  # whatever this disk has
    out = io.StringIO()
    started: list[StageAssignment] = []
    fit = JoinFit(load_config("8b"), 0, None, EventWriter(out), disk_dir=tmp_path, probe=lambda index: _card(16))
    start = fit.guard(lambda assignment, device: started.append(assignment))
    with pytest.raises(GpuRefused, match="cannot hold stage tail"):
        start(StageAssignment("tail", "http://127.0.0.1:1/snapshot"))
    assert started == []  # no download for a stage this GPU cannot hold
    start(StageAssignment("body1", "http://127.0.0.1:1/snapshot"))
    assert [a.stage for a in started] == ["body1"] and fit.max_batch_size == largest_microbatch(
        load_config("8b"), "body1", 16 * GIB
    )
    logged = [json.loads(line) for line in out.getvalue().splitlines()]
    assert any(event["kind"] == "log" and "holds stage body1" in event["message"] for event in logged)
    with pytest.raises(GpuRefused, match="compute capability 6.1"):
        JoinFit(
            load_config("8b"),
            0,
            None,
            EventWriter(out),
            disk_dir=tmp_path,
            probe=lambda index: _card(24, (6, 1), "GTX 1080"),
        )
    assert (
        JoinFit(load_config("tiny"), None, None, EventWriter(out), disk_dir=tmp_path).gpu is None
    )  # a CPU worker: nothing to check


def test_describe_8b_prints_counts_beside_the_documents_and_the_memory_plan(
    capsys: pytest.CaptureFixture[str], hub_offline
) -> None:
    assert describe.run(argparse.Namespace(preset="8b", json=True)) == 0
    info = json.loads(capsys.readouterr().out)
    run = load_config("8b")
    for stage, plan in zip(info["stages"], info["memory"], strict=True):
        assert 0.99 < stage["parameters"] / stage["documented"] < 1.01
        assert plan["gpu_peak"] == plan_stage(run, stage["name"]).gpu_peak
        assert plan["largest_microbatch"]["24GiB"] == largest_microbatch(run, stage["name"], 24 * GIB)
    assert describe.run(argparse.Namespace(preset="8b", json=False)) == 0
    table = capsys.readouterr().out
    assert "documents" in table and "1.37B" in table and "GPU peak" in table and "host" in table


def test_flop_formula_counts_grouped_query_attention() -> None:
    from torch.nn.attention import SDPBackend

    from agora_client.monitor.flops import backward_flops, forward_flops
    from tests.test_flops import BATCH, SEQ, measure

    config = load_config("tiny", {"model": {"n_kv_heads": 1}}).model
    for stage in ("head", "tail"):
        measured_forward, measured_backward = measure(config, stage, SDPBackend.MATH)
        assert forward_flops(config, stage, BATCH, SEQ) == measured_forward
        assert backward_flops(config, stage, BATCH, SEQ) == measured_backward
