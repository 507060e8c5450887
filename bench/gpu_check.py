"""One check of the 8b stages on a real GPU, unattended, within a wall budget (default 7 minutes).

Usage: python3 bench/gpu_check.py [--budget-s 420] [--cuda-index 0] [--preset 8b] [--max-microbatch N]
       python3 bench/gpu_check.py --dry     # the same code path on the CPU with the tiny preset, in seconds

Sections, in this order (an exception or an out-of-memory error is recorded with its section, or its stage, and
the check goes on; a section not begun within the budget is listed as skipped, and one still running when the
budget is spent is cut: the check then reports what it has and ends):
1. device: name, compute capability, memory, CUDA runtime; NVML's driver and its view of the same card, found by
   UUID (or PCI address); without NVML the JSON says so.
2. stages: the head, the first body and the tail, each where the join-time fit check (agora_client/joining/
   gpu_fit.py) takes it on this card, at the largest microbatch it allows and in the layout it picks
   (agora_client/model/memory.py LAYOUTS): built in a background thread as a contributor builds it, then a forward
   and a recomputing backward request under BF16 autocast (asserted on) and the offloaded AdamW step
   (bench/_gpu_stage_run.py). Peak memory (allocated and reserved) over the plan's figure
   (agora_client/model/memory.py), forward + backward time, tokens/s, MFU against the card's dense BF16 peak with
   6 x parameters x tokens as the useful work (the recomputed forward not counted), and the AdamW step on its own.
3. home_card: a 24 GiB card emulated by holding torch's allocator to what such a card leaves it: the head, the
   body and the tail train at the microbatch and in the layout the plan picks for 24 GiB (the tail in the offload
   layout: BF16 weights on the card, FP32 masters, gradient sum and AdamW on the host).
4. small_card: a 16 GiB card emulated the same way: the body trains; the fit check refuses the tail with the
   plan's numbers. --dry: cards sized from the tiny plan so that the fit check decides as it does at 8b
   (bench/_gpu_sections.py, dry_card_bytes), without a cap (the CPU has none).
5. numerics: the body's BF16 forward against FP32 (relative error); E_f rows hashed on the device against the CPU.
6. bandwidth: pinned host <-> device copy rate (GB/s each way), which the offloaded AdamW's chunks ride on.

Targets: peak / plan within 0.9-1.1 for every stage run; the home card trains the head, the body and the tail (the
tail in the offload layout); the small card trains the body and refuses the tail; MFU >= 0.35 on the body; E_f rows
match and the BF16 error is at most 0.05; hivemind never imported. A figure not measured (the CPU has no device
peak and no MFU) is null. Each miss is printed, and listed in the JSON, with
the stage and by how much. The last line is one JSON object. Exit status: 0 when every section ran and nothing
missed, 1 otherwise, 2 without a CUDA device (use --dry there), 3 when cut at the budget.

Only the model, the memory plan, the optimizer, the fit check and the GPU probe are imported, never hivemind: a GPU
machine needs python3 with a CUDA torch, safetensors, pyyaml, numpy, psutil, nvidia-ml-py and the wheels of
bench/gpu_requirements.txt (README.md, "GPU check").
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # agora_client from this checkout: not installed there

import torch  # noqa: E402
from _gpu_sections import (  # noqa: E402
    allocator_cap,
    bf16_against_fp32,
    card_of,
    device_facts,
    emulated_card,
    hashed_rows_against_cpu,
    pinned_copy_rate,
    tail_refusal,
)
from _gpu_stage_run import measure_stage, peak_bf16_flops, release  # noqa: E402

from agora_client.config import RunConfig, load_config  # noqa: E402
from agora_client.joining.gpu_fit import GpuRefused, fit_stage  # noqa: E402
from agora_client.model.memory import gib  # noqa: E402
from agora_client.system.cuda_allocator import use_expandable_segments  # noqa: E402
from agora_client.system.gpu import GpuSpec  # noqa: E402

SECTIONS = ("device", "stages", "home_card", "small_card", "numerics", "bandwidth")
BUDGET_S = 420.0
PEAK_RANGE = (0.9, 1.1)
MFU_TARGET = 0.35
BF16_ERROR_LIMIT = 0.05
ERROR_CHARS = 800  # an out-of-memory message runs long; its head says what failed


def say(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:ERROR_CHARS]


class Check:
    """Runs the sections in order within the budget; whatever happens, one JSON line ends the output."""

    def __init__(self, budget_s: float, device: torch.device, header: dict):
        self.budget_s, self.device, self.started = budget_s, device, time.monotonic()
        self.report: dict[str, Any] = {**header, "budget_s": budget_s, "sections": {}, "skipped": []}
        self.lock = threading.Lock()  # the report, between the sections and the budget's watchdog
        self.current: str | None = None
        self.partial: list[dict] = []  # the running section's stage runs, reported if it is cut
        self.finished = False
        self.watchdog = threading.Timer(budget_s, self._cut)
        self.watchdog.daemon = True
        self.watchdog.start()

    def section(self, name: str, work: Callable[[], dict]) -> None:
        say(f"{name} ...")
        with self.lock:
            self.current, self.partial = name, []
        started = time.monotonic()
        try:
            result = {"ok": True, **work()}
        except Exception as error:  # recorded; the next section runs regardless
            result = {"ok": False, "error": describe(error)}
        release(self.device)
        result["seconds"] = round(time.monotonic() - started, 2)
        with self.lock:
            self.report["sections"][name], self.current = result, None
        say(f"{name}: {'ok' if result['ok'] else 'FAILED ' + result['error']} ({result['seconds']} s)")

    def attempt(self, work: Callable[[], dict], **identity: str) -> dict:
        """One stage run (or one part of a section) on its own: a failure is recorded and the section goes on."""
        try:
            item = {**identity, **work()}
        except Exception as error:
            item = {**identity, "error": describe(error)}
        release(self.device)  # after the failure's traceback, which held the stage, is gone
        with self.lock:
            self.partial.append(item)
        say(item_line(item))
        return item

    def _cut(self) -> None:
        """The budget is spent: the running section is cut (its finished stage runs kept), the rest skipped."""
        with self.lock:
            if self.finished:
                return
            if self.current is not None:
                error = f"cut when the budget of {self.budget_s:.0f} s was spent"
                self.report["sections"][self.current] = {"ok": False, "error": error, "runs": list(self.partial)}
            self.report["skipped"] += [name for name in SECTIONS if name not in self.report["sections"]]
            self._emit()
        os._exit(3)  # the running section may be deep in CUDA work: nothing waits for it

    def finish(self) -> int:
        with self.lock:
            self.watchdog.cancel()
            return 0 if self._emit() else 1

    def _emit(self) -> bool:
        self.finished = True
        report = self.report
        report["elapsed_s"] = round(time.monotonic() - self.started, 1)
        report["imports"] = imported_packages()
        report["targets"], report["misses"] = judge(report, on_gpu=self.device.type == "cuda")
        report["pass"] = passed(report)
        for name, target in report["targets"].items():
            verdict = {True: "pass", False: "FAIL", None: "not measured"}[target["pass"]]
            say(f"target {name}: {verdict} ({target['detail']})")
        for miss in report["misses"]:
            say(f"MISS {miss}")
        print(json.dumps(report), flush=True)
        return report["pass"]


def item_line(item: dict) -> str:
    name = item.get("part") or item.get("stage")
    if "error" in item or "skipped" in item:
        return f"{name}: {'FAILED ' + item['error'] if 'error' in item else 'skipped: ' + item['skipped']}"
    if "peak_vs_plan" not in item:  # a part of the numerics
        return f"{name}: " + ", ".join(f"{key} {value}" for key, value in item.items() if key != "part")
    ratio = "n/a" if item["peak_vs_plan"] is None else f"{item['peak_vs_plan']:.3f}"
    mfu = "n/a" if item["mfu"] is None else f"{item['mfu']:.3f}"
    return (
        f"{name}: {item['microbatch']} seq, autocast {item['autocast']}, peak/plan {ratio}, forward + backward "
        f"{item['step_s']:.3f} s, {item['tokens_per_s']:.0f} tokens/s, MFU {mfu}, AdamW step "
        f"{item['optimizer_step_s']:.3f} s"
    )


def checked_stages(run: RunConfig) -> tuple[str, ...]:
    """The head, one body (every body has the same shapes) and the tail."""
    names = run.model.stage_names
    return names[0], names[1], names[-1]


def fitted_run(
    run: RunConfig,
    stage: str,
    card: GpuSpec,
    device: torch.device,
    max_microbatch: int | None,
    peak: tuple[float | None, str],
) -> dict:
    """The stage at the largest microbatch the join-time fit check allows on ``card`` (at most ``max_microbatch``);
    a stage the card cannot hold is skipped with the check's reason."""
    try:
        decision = fit_stage(run, stage, card)
    except GpuRefused as refusal:
        return {"stage": stage, "skipped": f"does not fit: {refusal}"}
    microbatch = decision.microbatch if max_microbatch is None else min(decision.microbatch, max_microbatch)
    return {
        "largest_microbatch": decision.largest,
        **measure_stage(run, stage, microbatch, device, peak, decision.layout),
    }


def peak_of(card: GpuSpec, device: torch.device) -> tuple[float | None, str]:
    return peak_bf16_flops(card.name) if device.type == "cuda" else (None, "the CPU: MFU is measured on GPUs")


def stages_section(check: Check, run: RunConfig, device: torch.device, max_microbatch: int | None) -> dict:
    card = card_of(device)
    peak = peak_of(card, device)
    runs = [
        check.attempt(lambda stage=stage: fitted_run(run, stage, card, device, max_microbatch, peak), stage=stage)
        for stage in checked_stages(run)
    ]
    return {"card": card.name, "capacity": card.capacity, "peak_bf16": peak[1], "runs": runs}


def emulated_card_section(
    check: Check, run: RunConfig, device: torch.device, dry: bool, max_microbatch: int | None, home: bool
) -> dict:
    """The home card (24 GiB) trains the head, the body and the tail; the small one (16 GiB) the body, and the fit
    check's answer for the tail is reported."""
    real = card_of(device)
    card, peak = emulated_card(run, real, dry, home), peak_of(real, device)
    stages = checked_stages(run) if home else checked_stages(run)[1:2]
    with allocator_cap(device, card.capacity) as cap:
        runs = [
            check.attempt(lambda stage=stage: fitted_run(run, stage, card, device, max_microbatch, peak), stage=stage)
            for stage in stages
        ]
    section = {"card": card.name, "capacity": card.capacity, "allocator": cap, "runs": runs}
    return section if home else {**section, "tail": tail_refusal(run, card)}


def numerics_section(check: Check, run: RunConfig, device: torch.device) -> dict:
    return {
        "bf16_forward": check.attempt(lambda: bf16_against_fp32(run, device), part="bf16_forward"),
        "ef_rows": check.attempt(lambda: hashed_rows_against_cpu(run, device), part="ef_rows"),
    }


def imported_packages() -> dict:
    """Whether hivemind was loaded, and the installed distributions whose modules this process imported."""
    owners = importlib.metadata.packages_distributions()
    tops = {name.partition(".")[0] for name in list(sys.modules)} - set(sys.stdlib_module_names)
    found = sorted({dist for top in tops for dist in owners.get(top, ())})
    return {"hivemind": "hivemind" in sys.modules, "distributions": found}


def _runs(report: dict, section: str) -> list[dict]:
    return report["sections"].get(section, {}).get("runs", [])


def _unmeasured(on_gpu: bool, what: str) -> dict:
    """A target with nothing to judge: a failure on a GPU, where it should have been measured; null on the CPU."""
    return {"pass": False if on_gpu else None, "detail": f"not measured: {what}"}


def peak_target(report: dict, on_gpu: bool) -> tuple[dict, list[str]]:
    low, high = PEAK_RANGE
    ratios, misses = {}, []
    for section in ("stages", "home_card", "small_card"):
        for item in _runs(report, section):
            if item.get("peak_vs_plan") is None:
                continue
            label = f"{item['stage']} ({section}, {item['microbatch']} seq)"
            ratio = ratios[label] = round(item["peak_vs_plan"], 3)
            if not low <= ratio <= high:
                off = f"{ratio - high:.3f} above {high}" if ratio > high else f"{low - ratio:.3f} below {low}"
                misses.append(
                    f"peak/plan of {label} is {ratio:.3f}, {off}: measured {gib(item['peak_allocated'])}, "
                    f"planned {gib(item['planned_peak'])}"
                )
    if not ratios:
        return _unmeasured(on_gpu, "no stage's peak (the CPU has no device allocator to read)"), []
    return {"pass": not misses, "detail": f"target {low}-{high}", "ratios": ratios}, misses


def _untrained(section: dict, label: str) -> list[str]:
    return [
        f"{label} ({section['card']}): {item['stage']} did not train: {item.get('error') or item.get('skipped')}"
        for item in section["runs"]
        if "error" in item or "skipped" in item
    ]


def home_card_target(report: dict) -> tuple[dict, list[str]]:
    section = report["sections"].get("home_card", {})
    if not section.get("ok"):
        return {"pass": False, "detail": "the section did not run to its end"}, ["home card: the section did not run"]
    misses = _untrained(section, "home card")
    tail = next((item for item in section["runs"] if item["stage"] == "tail"), {})
    if "layout" in tail and tail["layout"] != "offload":
        misses.append(f"home card ({section['card']}): the tail ran in the {tail['layout']} layout, not offload")
    detail = f"{section['card']}: head, body and tail train, the tail in the offload layout"
    return {"pass": not misses, "detail": detail}, misses


def small_card_target(report: dict) -> tuple[dict, list[str]]:
    section = report["sections"].get("small_card", {})
    if not section.get("ok"):
        return {"pass": False, "detail": "the section did not run to its end"}, ["small card: the section did not run"]
    misses = _untrained(section, "small card")
    if not section["tail"]["refused"]:
        misses.append(
            f"small card ({section['card']}): the fit check took the tail at {section['tail']['microbatch']} seq"
        )
    return {"pass": not misses, "detail": f"{section['card']}: the body trains, the tail is refused"}, misses


def mfu_target(report: dict, body_stage: str, on_gpu: bool) -> tuple[dict, list[str]]:
    body = next((item for item in _runs(report, "stages") if item.get("stage") == body_stage), {})
    if body.get("mfu") is None:
        why = body.get("mfu_note") or body.get("error") or body.get("skipped") or "no run"
        return _unmeasured(on_gpu, f"{body_stage}'s MFU ({why})"), []
    mfu = body["mfu"]
    detail = f"{body_stage} at {body['microbatch']} seq: {mfu:.3f}, target >= {MFU_TARGET}"
    if mfu >= MFU_TARGET:
        return {"pass": True, "detail": detail}, []
    return {"pass": False, "detail": detail}, [
        f"MFU of {body_stage} is {mfu:.3f}, {MFU_TARGET - mfu:.3f} below {MFU_TARGET}"
    ]


def numerics_target(report: dict) -> tuple[dict, list[str]]:
    section = report["sections"].get("numerics", {})
    forward, rows = section.get("bf16_forward", {}), section.get("ef_rows", {})
    misses = []
    if not forward.get("relative_error", float("inf")) <= BF16_ERROR_LIMIT:
        error = forward.get("relative_error", forward.get("error"))
        misses.append(f"BF16 forward of {forward.get('stage')}: relative error {error}, limit {BF16_ERROR_LIMIT}")
    if not rows.get("close"):
        difference = rows.get("max_abs_diff", rows.get("error"))
        misses.append(f"E_f rows on {rows.get('device')} differ from the CPU's: {difference}")
    return {
        "pass": not misses,
        "detail": f"BF16 relative error <= {BF16_ERROR_LIMIT}, E_f rows equal the CPU's",
    }, misses


def judge(report: dict, on_gpu: bool) -> tuple[dict, list[str]]:
    body = report["body_stage"]
    judged = {
        "peak_vs_plan": peak_target(report, on_gpu),
        "home_card": home_card_target(report),
        "small_card": small_card_target(report),
        "mfu_body": mfu_target(report, body, on_gpu),
        "numerics": numerics_target(report),
        "no_hivemind": (
            {"pass": not report["imports"]["hivemind"], "detail": "hivemind never imported"},
            ["hivemind was imported"] if report["imports"]["hivemind"] else [],
        ),
    }
    return {name: target for name, (target, _) in judged.items()}, [
        miss for _, misses in judged.values() for miss in misses
    ]


def passed(report: dict) -> bool:
    """Every section ran to its end, no stage run failed, and no target failed (null ones were not measured)."""
    sections_ok = not report["skipped"] and all(section["ok"] for section in report["sections"].values())
    sections = ("stages", "home_card", "small_card")
    runs_ok = not any("error" in item for name in sections for item in _runs(report, name))
    return sections_ok and runs_ok and all(target["pass"] is not False for target in report["targets"].values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry", action="store_true", help="on the CPU with the tiny preset, in seconds (what the tests run)"
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget in seconds (420)")
    parser.add_argument(
        "--cuda-index", type=int, default=0, help="the GPU in CUDA's numbering (CUDA_VISIBLE_DEVICES applies)"
    )
    parser.add_argument("--preset", default=None, help="run config preset or YAML file (8b; --dry: tiny)")
    parser.add_argument(
        "--max-microbatch",
        type=int,
        default=None,
        help="cap the microbatch the plan picks (--dry: the run's own microbatch, to stay in seconds)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_expandable_segments()  # as the worker's process does (agora_client/cli.py)
    if not args.dry and not torch.cuda.is_available():
        say("torch sees no CUDA device: run this on a GPU machine with a CUDA build of torch, or pass --dry")
        print(json.dumps({"bench": "gpu_check", "error": "no CUDA device visible to torch", "pass": False}))
        return 2
    device = torch.device("cpu") if args.dry else torch.device("cuda", args.cuda_index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run = load_config(args.preset or ("tiny" if args.dry else "8b"))
    max_microbatch = args.max_microbatch or (run.optim.microbatch_size if args.dry else None)
    torch.manual_seed(0)
    check = Check(
        args.budget_s,
        device,
        {
            "bench": "gpu_check",
            "dry": args.dry,
            "preset": run.name,
            "device": str(device),
            "body_stage": checked_stages(run)[1],
        },
    )
    check.section("device", lambda: device_facts(device))
    check.section("stages", lambda: stages_section(check, run, device, max_microbatch))
    check.section("home_card", lambda: emulated_card_section(check, run, device, args.dry, max_microbatch, True))
    check.section("small_card", lambda: emulated_card_section(check, run, device, args.dry, max_microbatch, False))
    check.section("numerics", lambda: numerics_section(check, run, device))
    check.section("bandwidth", lambda: pinned_copy_rate(device))
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
