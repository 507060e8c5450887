"""bench/gpu_check.py cannot rot without a GPU: its --dry run (the same code path on the CPU with tiny) reports every
section, and its imports are what a CUDA machine image and bench/gpu_requirements.txt provide, hivemind never."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agora_client.config import load_config
from agora_client.model.layers import native_bf16
from agora_client.model.memory import plan_stage, usable_bytes

ROOT = Path(__file__).resolve().parent.parent
CUDA_IMAGE = (
    "torch",
    "numpy",
    "safetensors",
    "PyYAML",
    "psutil",
    "nvidia-ml-py",
)  # with python3, what the issue assumes

sys.path.append(str(ROOT / "bench"))  # last: bench/ holds names like memory.py and download.py
import gpu_check  # noqa: E402
from _gpu_stage_run import peak_bf16_flops  # noqa: E402


@pytest.fixture(scope="module")
def dry_report() -> dict:
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_dry_run_reports_every_section(dry_report: dict) -> None:
    assert dry_report["dry"] and dry_report["preset"] == "tiny" and dry_report["device"] == "cpu"
    assert list(dry_report["sections"]) == list(gpu_check.SECTIONS)
    assert dry_report["skipped"] == []
    assert all(section["ok"] for section in dry_report["sections"].values()), dry_report["sections"]
    assert dry_report["pass"] is True
    nvml = dry_report["sections"]["device"]["nvml"]
    assert nvml["available"] is False and nvml["note"]  # no driver here: said, not raised


def test_dry_run_trains_head_body_and_tail_under_the_workers_autocast(dry_report: dict) -> None:
    runs = {run["stage"]: run for run in dry_report["sections"]["stages"]["runs"]}
    assert list(runs) == ["head", "body1", "tail"]
    expected_autocast = "bfloat16" if native_bf16(torch.device("cpu")) else "float32"
    run_config = load_config("tiny")
    for stage, run in runs.items():
        assert run["finite"] and run["autocast"] == expected_autocast, run
        assert run["microbatch"] == run_config.optim.microbatch_size  # --dry caps the plan's pick at the run's own
        assert run["largest_microbatch"] >= run["microbatch"]
        assert run["step_s"] > 0 and run["optimizer_step_s"] > 0 and run["tokens_per_s"] > 0
        assert run["layout"] == "fp32"  # the CPU's RAM as a card holds every tiny stage in fp32
        assert run["planned_peak"] == plan_stage(run_config, stage, run["microbatch"]).gpu_peak
        assert run["peak_vs_plan"] is None and run["mfu"] is None  # the CPU has neither
    assert math.isfinite(runs["tail"]["loss"]) and 0 < runs["tail"]["loss"] < 2 * math.log(run_config.model.vocab_size)


def test_dry_run_home_card_trains_head_body_and_the_tail_offloaded(dry_report: dict) -> None:
    """The 24 GiB card's stand-in: head and body in fp32, the tail (which fp32 does not fit) in the offload layout,
    its bf16 copy under bf16 autocast whatever the CPU, its peak planned in that layout."""
    section, run_config = dry_report["sections"]["home_card"], load_config("tiny")
    runs = {run["stage"]: run for run in section["runs"]}
    assert list(runs) == ["head", "body1", "tail"] and all(run["finite"] for run in runs.values())
    assert [runs[stage]["layout"] for stage in runs] == ["fp32", "fp32", "offload"]
    assert runs["tail"]["autocast"] == "bfloat16"
    tail = runs["tail"]
    assert tail["planned_peak"] == plan_stage(run_config, "tail", tail["microbatch"], layout="offload").gpu_peak
    assert usable_bytes(section["capacity"]) < plan_stage(run_config, "tail").gpu_peak  # fp32 does not fit
    assert math.isfinite(tail["loss"]) and math.isfinite(tail["grad_norm"]) and tail["grad_norm"] > 0
    assert dry_report["targets"]["home_card"]["pass"] is True


def test_dry_run_small_card_trains_the_body_and_refuses_the_tail(dry_report: dict) -> None:
    section = dry_report["sections"]["small_card"]
    assert [run["stage"] for run in section["runs"]] == ["body1"] and section["runs"][0]["finite"]
    tail = section["tail"]
    assert tail["refused"] is True and "stage tail" in tail["reason"] and tail["layout"] == "offload"
    assert tail["usable"] == usable_bytes(section["capacity"]) < tail["planned_peak"]
    tiny = load_config("tiny")
    assert tail["planned_peak"] == plan_stage(tiny, "tail", layout="offload").gpu_peak  # at the run's microbatch
    assert dry_report["targets"]["small_card"]["pass"] is True


def test_dry_run_numerics_and_bandwidth(dry_report: dict) -> None:
    numerics = dry_report["sections"]["numerics"]
    assert 0 < numerics["bf16_forward"]["relative_error"] < gpu_check.BF16_ERROR_LIMIT  # bf16 really ran, and close
    rows = numerics["ef_rows"]
    assert rows["bitwise_equal"] is True and rows["close"] is True
    assert rows["distinct"] < rows["rows"]  # repeated tokens went through torch.unique's inverse
    bandwidth = dry_report["sections"]["bandwidth"]
    assert bandwidth["host_to_device_gb_s"] > 0 and bandwidth["device_to_host_gb_s"] > 0


def test_dry_run_judges_only_what_the_cpu_measures(dry_report: dict) -> None:
    targets = dry_report["targets"]
    assert targets["peak_vs_plan"]["pass"] is None and targets["mfu_body"]["pass"] is None
    assert targets["numerics"]["pass"] is True and targets["no_hivemind"]["pass"] is True
    assert dry_report["imports"]["hivemind"] is False and dry_report["misses"] == []


def test_the_budget_cuts_the_running_section_and_skips_the_rest() -> None:
    result = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry", "--budget-s", "0.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 3, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    cut = [name for name, section in report["sections"].items() if "cut when the budget" in section.get("error", "")]
    assert len(cut) == 1 and report["pass"] is False
    assert [*report["sections"], *report["skipped"]] == list(
        gpu_check.SECTIONS
    )  # every section accounted for, in order
    assert "bandwidth" in report["skipped"]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_requirements(names: list[str]) -> set[str]:
    """The distributions and everything they require (extras aside), as installed here."""
    found, todo = set(), [_normal(name) for name in names]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [
            _normal(re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0]) for line in requires if "extra ==" not in line
        ]
    return found


# Run in a fresh interpreter: every import of a distribution outside the allowed set fails, as on a GPU machine.
IMPORT_ONLY_THE_IMAGE = r"""
import importlib.metadata, json, re, sys
allowed = set(json.loads(sys.argv[1]))
owners = importlib.metadata.packages_distributions()
refused = []

class OnlyTheImage:
    def find_spec(self, name, path=None, target=None):
        owned_by = owners.get(name)
        if "." in name or not owned_by or any(re.sub(r"[-_.]+", "-", d).lower() in allowed for d in owned_by):
            return None
        refused.append(name)
        raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)

sys.meta_path.insert(0, OnlyTheImage())
sys.path.insert(0, "bench")
import gpu_check
print(json.dumps({"hivemind": "hivemind" in sys.modules, "refused": refused}))
"""


def test_the_checks_imports_need_only_the_cuda_image_and_its_wheels() -> None:
    wheels = [
        line.split("==")[0]
        for line in (ROOT / "bench" / "gpu_requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "pydantic" in wheels
    allowed = _with_requirements([*CUDA_IMAGE, *wheels]) | {"agora"}  # agora: this checkout, on the path there too
    assert "hivemind" not in allowed
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ONLY_THE_IMAGE, json.dumps(sorted(allowed))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert imported["hivemind"] is False
    assert "hivemind" not in imported["refused"]  # not even tried


def test_card_peaks_by_name() -> None:
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090")[0] == 165e12
    assert peak_bf16_flops("NVIDIA L40S")[0] == 362e12 and peak_bf16_flops("NVIDIA L4")[0] == 121e12
    flops, reason = peak_bf16_flops("NVIDIA A10G")  # neither the A10 nor the A100
    assert flops is None and "A10G" in reason


def _stage_run(stage: str, section: str, ratio: float, mfu: float | None) -> dict:
    return {
        "stage": stage,
        "microbatch": 4,
        "peak_vs_plan": ratio,
        "peak_allocated": int(ratio * 2**33),
        "planned_peak": 2**33,
        "mfu": mfu,
        "mfu_note": "H100",
        "section": section,
    }


def test_a_miss_says_which_stage_and_by_how_much() -> None:
    report = {
        "body_stage": "body1",
        "imports": {"hivemind": False},
        "skipped": [],
        "sections": {
            "stages": {
                "ok": True,
                "runs": [_stage_run("head", "stages", 1.02, 0.4), _stage_run("body1", "stages", 1.17, 0.29)],
            },
            "home_card": {
                "ok": True,
                "card": "H100 held to 24.00 GiB",
                "runs": [
                    _stage_run("head", "home_card", 0.85, 0.4),
                    {"stage": "body1", "error": "OutOfMemoryError: CUDA out of memory"},
                    {**_stage_run("tail", "home_card", 1.0, None), "layout": "fp32"},
                ],
            },
            "small_card": {
                "ok": True,
                "card": "H100 held to 16.00 GiB",
                "runs": [_stage_run("body1", "small_card", 1.0, 0.4)],
                "tail": {"refused": False, "microbatch": 1},
            },
            "numerics": {
                "ok": True,
                "bf16_forward": {"stage": "body1", "relative_error": 0.01},
                "ef_rows": {"close": True},
            },
        },
    }
    targets, misses = gpu_check.judge(report, on_gpu=True)
    assert targets["peak_vs_plan"]["pass"] is False and targets["mfu_body"]["pass"] is False
    assert targets["home_card"]["pass"] is False and targets["small_card"]["pass"] is False
    assert targets["numerics"]["pass"] is True
    text = "\n".join(misses)
    assert "body1 (stages, 4 seq) is 1.170, 0.070 above 1.1" in text
    assert "head (home_card, 4 seq) is 0.850, 0.050 below 0.9" in text
    assert "MFU of body1 is 0.290, 0.060 below 0.35" in text
    assert "body1 did not train: OutOfMemoryError" in text and "the tail ran in the fp32 layout" in text
    assert "took the tail at 1 seq" in text
    report["targets"] = targets
    assert gpu_check.passed(report) is False
