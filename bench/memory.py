"""Measured peak memory of one stage step against the memory plan (agora_client/model/memory.py).

One stage step is what a worker does: a backward request through the worker's StageBackend (the forward re-run
under the run's autocast, then backward, accumulating into fp32 gradients already there from earlier requests of
the epoch), then the optimizer step (OffloadAdamW, moments on the host when the run offloads them). The peak over
both is compared with the plan for the precision the device really runs (a device without native bf16 runs the
fp32 layout in fp32: model/layers.py, runs_bf16).

Each stage is measured in the fp32 layout, and again in the layout the 8b preset's stage takes on a 24 GiB card
where that is another (the tail: "offload", model/memory.py LAYOUTS). In the offload layout the device holds the
bf16 copy (serving/device_copy.py) and the step runs on the host: the device's side of it is the refresh of the
copy, measured on its own after the step.

- CUDA (default when a GPU is present): the 8b preset; the peak is torch.cuda.max_memory_allocated.
  Stages whose plan exceeds the card are reported as skipped, with their planned bytes.
- CPU: a scaled 8b (every width / 8, sequence 512, same layer split and GQA ratio); the peak is the
  CPU allocator's, from the profiler's running "Total Allocated" over the step, plus the bytes the
  stage's tensors held on the device when the step began (weights, frozen basis, gradients; moments if not
  offloaded; in the offload layout the copy's bf16 weights and frozen basis).

- Export (`agora export`): a checkpoint set of the 8b layer split at width --export-width (640: the scaled 8b
  above; 128 for a quick check) is exported in a fresh process, fp32 and bf16, while a thread samples its RSS
  (psutil). The peak above the RSS before the export is compared with what the streamed export may hold: the
  largest stage plus the largest shard it wrote (shards of a quarter stage, so there are several).

- Snapshot load: each of --stages at width --load-width (640: the scaled 8b; 256 for a quick check) is saved with
  both AdamW moments by one fresh process; another builds the stage as a joiner does (weights left unset) and
  loads the snapshot into it and its optimizer, while a thread samples its RSS (psutil). The peak above the RSS
  before the build (taken after a first build of the stage, dropped: imports and what the allocator keeps from
  building the basis belong to the process, not to the load) is compared with what the stage holds in host
  memory by the plan on the CPU: weights, frozen basis and both moments (no gradients: they appear at the first
  backward). The streamed load may add one tensor of the files (``largest_tensor``) above that.

Usage: python bench/memory.py [--device cuda|cpu] [--stages head,body1,tail] [--microbatch N] [--fp32] [--no-offload]
                              [--export-width W] [--load-width W]
The last line is one JSON object: per stage and layout the measured and planned peaks and their ratio, and
max_ratio over them (target: every ratio within 0.9-1.1).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import tempfile
import threading
from pathlib import Path
from typing import Callable

import psutil
import torch
from hivemind.utils.tensor_descr import BatchTensorDescriptor
from torch.profiler import ProfilerActivity, profile

from agora_client.config import RunConfig, load_config
from agora_client.model import build_stage
from agora_client.model.layers import runs_bf16
from agora_client.model.memory import choose_layout, gib, plan_stage, usable_bytes
from agora_client.serving.backend import StageBackend
from agora_client.serving.device_copy import DeviceCopy
from agora_client.snapshots import load_stage_snapshot, save_stage_snapshot
from agora_client.worker.optimizer import build_optimizer

# The 8b preset with every width divided by 8 (head dim and the layer split kept): fits a CPU run.
SCALED_8B = {
    "name": "8b-scaled",
    "model": {"d_model": 640, "n_heads": 5, "n_kv_heads": 1, "ffn_hidden": 2304, "vocab_size": 16032, "seq_len": 512},
}
HOME_CARD_BYTES = 24 * 2**30  # the card whose layout each 8b stage is measured in too


def _inputs(
    module, run: RunConfig, microbatch: int, device: torch.device, autocast=contextlib.nullcontext
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, run.model.vocab_size, (microbatch, run.model.seq_len), generator=generator).to(device)
    if module.stage == "head":
        inputs: tuple[torch.Tensor, ...] = (tokens,)
    else:
        boundary = torch.randn(microbatch, run.model.seq_len, module.boundary_width, generator=generator).to(device)
        inputs = (boundary, tokens, tokens) if module.stage == "tail" else (boundary, tokens)
    with torch.no_grad(), autocast():
        output = module(*inputs)
    return inputs, torch.randn(output.shape, generator=generator).to(device) * 1e-3


def _tensor_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values())


def _resident_bytes(module, optimizer, offload: bool) -> int:
    """Bytes the stage's own tensors hold on its device right now (fp32 layout)."""
    tensors = [*module.parameters(), *module.buffers(), *(p.grad for p in module.parameters() if p.grad is not None)]
    if not offload:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return _tensor_bytes(tensors)


class PeakMeter:
    """The device allocator's peak over a window: CUDA's counter, or on the CPU the profiler's running total above
    ``resident()``, what the stage's tensors hold on the device when the window opens."""

    def __init__(self, device: torch.device, resident: Callable[[], int]):
        self.device, self.resident = device, resident

    def measure(self, work) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            work()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        before = self.resident()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            work()
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            profiler.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        totals = [event["args"]["Total Allocated"] for event in events if event.get("name") == "[memory]"]
        return before + max(totals, default=0)


def planned_precision(run: RunConfig, device: torch.device, layout: str) -> bool | None:
    """The precision to plan ``layout`` with on ``device``: what it really runs (the offload layout: bf16 always)."""
    return None if layout == "offload" else runs_bf16(device, run.use_mixed_precision)


def _stage_backend(run: RunConfig, module, copy: DeviceCopy | None, inputs, grad_output, device) -> StageBackend:
    """The worker's backend (agora_client/worker/node.py) over the stage, or over its device copy."""
    return StageBackend(
        module.stage,
        module if copy is None else copy.module,
        device_copy=copy,
        lock=threading.Lock(),
        on_samples=lambda samples: None,
        device=device,
        mixed_precision=run.use_mixed_precision,
        on_forward=lambda tokens, outputs: None,
        on_backward=lambda tokens: None,
        on_unhealthy=lambda reason: None,
        args_schema=tuple(BatchTensorDescriptor.from_tensor(t) for t in inputs),
        outputs_schema=BatchTensorDescriptor.from_tensor(grad_output),
        min_batch_size=1,
        max_batch_size=grad_output.shape[0],
    )


def measure_stage(run: RunConfig, stage: str, microbatch: int, device: torch.device, layout: str = "fp32") -> dict:
    plan = plan_stage(run, stage, microbatch, layout=layout, mixed_precision=planned_precision(run, device, layout))
    offload = layout == "offload"
    module = build_stage(run.model, stage, seed=0, device="cpu" if offload else device)  # offload: masters on the host
    copy = DeviceCopy(module, run.model, device, seed=0) if offload else None
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(parameters, run)
    if copy is None:
        inputs, grad_output = _inputs(module, run, microbatch, device)
    else:
        copy.refresh()
        inputs, grad_output = _inputs(copy.module, run, microbatch, device, copy.autocast)
    backend = _stage_backend(run, module, copy, inputs, grad_output, device)

    def backward_request() -> None:  # forward again, then backward (and, offload: the gradients to the host)
        backend.backward(*inputs, grad_output)

    def optimizer_step() -> None:  # what EpochController._step runs
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    backward_request()  # warm-up: kernels, the optimizer's moments
    optimizer_step()
    backward_request()  # gradients now accumulate: the state of a worker for all but the first request of an epoch
    if copy is None:
        meter = PeakMeter(device, lambda: _resident_bytes(module, optimizer, run.offload_optimizer))
        backward_peak = meter.measure(backward_request)
        step_peak = meter.measure(optimizer_step)
    else:
        meter = PeakMeter(device, copy.device_bytes)
        backward_peak = meter.measure(backward_request)
        optimizer_step()  # on the host; the device's part is the copy's refresh from the new masters
        step_peak = meter.measure(copy.refresh)
    measured = max(backward_peak, step_peak)
    return {
        "stage": stage,
        "layout": layout,
        "microbatch": microbatch,
        "mixed_precision": plan.mixed_precision,
        "measured_peak": measured,
        "measured_backward_peak": backward_peak,
        "measured_step_peak": step_peak,
        "planned_peak": plan.gpu_peak,
        "ratio": measured / plan.gpu_peak,
    }


class RssPeak:
    """The highest resident set size of this process while the block runs, sampled by a thread."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.peak = every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        process = psutil.Process()
        while True:
            self.peak = max(self.peak, process.memory_info().rss)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


def _export_in_child(store_dir: str, out: str, dtype: str, max_shard_bytes: int, answer) -> None:
    """Runs in a fresh process, so the baseline holds no checkpoint-writing leftovers."""
    from agora_client.checkpoints import select_set
    from agora_client.checkpoints.export import export_set, export_tokenizer, set_run_config
    from agora_client.snapshots import LocalStore

    store = LocalStore(store_dir)
    checkpoints = select_set(store)
    # code, not data, belongs to the baseline: a stage's first to_empty() off the meta device imports torch.fx's
    # symbolic shapes (sympy, ~480 modules, ~50 MB at any size); the matmul library sets up on its first call
    torch.nn.Linear(1, 1, device="meta").to_empty(device="cpu")
    torch.ones(64, 64) @ torch.ones(64, 64)
    export_tokenizer(
        set_run_config(checkpoints)
    )  # and the tokenizers library the export loads the run's tokenizer with
    baseline = psutil.Process().memory_info().rss
    with RssPeak() as meter:
        export_set(store, checkpoints, Path(out), dtype=dtype, max_shard_bytes=max_shard_bytes)
    answer.send((baseline, meter.peak))


def _stage_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def measure_export(width: int) -> dict:
    """Host peak of `agora export` (fp32 and bf16) against the largest stage plus the largest shard written."""
    from agora_client.checkpoints import run_record
    from agora_client.snapshots import LocalStore

    results = []
    with tempfile.TemporaryDirectory() as folder:
        run = width_scaled(width)
        words = _word_tokenizer(Path(folder) / "tokenizer.json", run.model.vocab_size, run.tokenizer.eos_token)
        run = run.model_copy(update={"tokenizer": run.tokenizer.model_copy(update={"source": str(words)})})
        store = LocalStore(Path(folder) / "store")
        largest = 0
        for stage in run.model.stage_names:  # one stage in memory at a time here too
            module = build_stage(run.model, stage, seed=run.seed)
            largest = max(largest, _stage_bytes(module))
            store.save(stage, module, torch.optim.AdamW(module.parameters()), 1, extra={"run": run_record(run)})
            del module
        context = multiprocessing.get_context("spawn")
        for dtype in ("fp32", "bf16"):
            out = Path(folder) / f"hf-{dtype}"
            receive, send = context.Pipe(duplex=False)
            child = context.Process(
                target=_export_in_child, args=(str(store.root), str(out), dtype, largest // 4, send)
            )
            child.start()
            baseline, peak = receive.recv()
            child.join()
            shard = max(path.stat().st_size for path in out.glob("model*.safetensors"))
            plan = largest + shard
            results.append(
                {
                    "dtype": dtype,
                    "baseline_rss": baseline,
                    "peak_rss_above_baseline": peak - baseline,
                    "largest_stage": largest,
                    "largest_shard": shard,
                    "planned_peak": plan,
                    "ratio": (peak - baseline) / plan,
                    "shards": len(list(out.glob("model*.safetensors"))),
                }
            )
            print(
                f"export {dtype}: peak {gib(peak - baseline)} above the baseline, planned {gib(plan)} (stage + shard), "
                f"ratio {(peak - baseline) / plan:.3f}, {results[-1]['shards']} shards"
            )
    parameters = sum(
        p.numel()
        for stage in run.model.stage_names
        for p in build_stage(run.model, stage, seed=0, device="meta").parameters()
    )
    return {"width": width, "parameters": parameters, "runs": results, "max_ratio": max(r["ratio"] for r in results)}


def _word_tokenizer(path: Path, vocab_size: int, eos_token: str | None) -> Path:
    """A word-level tokenizers file of ``vocab_size`` entries for the export to write: the 8b preset's (Llama 3's,
    from the hub) cannot be fetched offline, and only its size matters here."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{index}" for index in range(vocab_size - 1)] + [eos_token or f"w{vocab_size - 1}"]
    tokenizer = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def width_scaled(width: int) -> RunConfig:
    """The scaled 8b (layer split kept) at d_model ``width``."""
    heads = max(1, width // 128)
    shape = {"d_model": width, "n_heads": heads, "n_kv_heads": max(1, heads // 5), "ffn_hidden": width * 36 // 10}
    return load_config("8b", {**SCALED_8B, "model": {**SCALED_8B["model"], **shape}})


def _save_snapshot_in_child(run: RunConfig, stage: str, folder: str) -> tuple[str, int]:
    """(A process of its own.) The stage with both AdamW moments saved under folder.

    Its directory, its largest tensor's bytes."""
    module = build_stage(run.model, stage, seed=0)
    parameters = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(parameters, run)
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # creates the moments
    moments = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    directory = save_stage_snapshot(Path(folder), stage, module, optimizer, epoch=1, keep=1)
    return str(directory), max(t.numel() * t.element_size() for t in (*module.state_dict().values(), *moments))


def _load_in_child(run: RunConfig, stage: str, directory: str) -> dict:
    """(A fresh process.) RSS before the stage is built, its peak over the build and the load, and after."""
    # A first build, dropped, leaves imports and what the allocator keeps from building the basis in the baseline.
    build_stage(run.model, stage, seed=0, seeded_weights=False)
    gc.collect()
    before = psutil.Process().memory_info().rss
    with RssPeak(every_s=0.001) as meter:
        module = build_stage(run.model, stage, seed=0, seeded_weights=False)  # a joiner's: the snapshot sets them
        optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], run)
        load_stage_snapshot(Path(directory), module, optimizer, stage=stage)
    return {"rss_before": before, "rss_peak": meter.peak, "rss_after": psutil.Process().memory_info().rss}


def measure_snapshot_load(run: RunConfig, stage: str) -> dict:
    """Host peak of loading the stage's snapshot against what the stage holds in host memory by the plan on the CPU."""
    plan = plan_stage(run, stage)
    planned = plan.weights + plan.frozen + plan.moments
    spawn = multiprocessing.get_context("spawn")  # fresh processes: nothing left over from the save or another stage
    with tempfile.TemporaryDirectory() as folder:
        with spawn.Pool(1) as pool:
            directory, largest = pool.apply(_save_snapshot_in_child, (run, stage, folder))
        with spawn.Pool(1) as pool:
            rss = pool.apply(_load_in_child, (run, stage, directory))
    measured = rss["rss_peak"] - rss["rss_before"]
    return {
        "stage": stage,
        "parameters": plan.weights // 4,
        **rss,
        "measured_peak": measured,
        "planned_stage_host": planned,
        "largest_tensor": largest,
        "ratio": measured / planned,
        "peak_above_loaded_stage": rss["rss_peak"] - rss["rss_after"],
    }


def stage_layouts(stage: str, switches: dict) -> list[str]:
    """fp32, and the layout the 8b preset's stage takes on a 24 GiB card where that is another."""
    home = choose_layout(load_config("8b", switches), stage, HOME_CARD_BYTES)
    return ["fp32"] + ([home] if home not in (None, "fp32") else [])


def measure_stages(
    run: RunConfig, stages: list[str], microbatch: int, device: torch.device, switches: dict
) -> tuple[list[dict], list[dict]]:
    """Each stage in each of its layouts (stage_layouts): (measured, skipped for exceeding this card)."""
    results, skipped = [], []
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    for stage in stages:
        for layout in stage_layouts(stage, switches):
            precision = planned_precision(run, device, layout)
            planned = plan_stage(run, stage, microbatch, layout=layout, mixed_precision=precision).gpu_peak
            if capacity is not None and planned > usable_bytes(capacity):
                print(
                    f"{stage} ({layout}): skipped, planned peak {gib(planned)} exceeds this card's usable "
                    f"{gib(usable_bytes(capacity))}"
                )
                skipped.append({"stage": stage, "layout": layout, "planned_peak": planned})
                continue
            result = measure_stage(run, stage, microbatch, device, layout)
            print(
                f"{stage} ({layout}, {'bf16' if result['mixed_precision'] else 'fp32'}): measured peak "
                f"{gib(result['measured_peak'])} (backward {gib(result['measured_backward_peak'])}, optimizer step "
                f"{gib(result['measured_step_peak'])}), planned {gib(result['planned_peak'])}, "
                f"ratio {result['ratio']:.3f}"
            )
            results.append(result)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stages", default="head,body1,tail", help="comma-separated stage names")
    parser.add_argument("--microbatch", type=int, default=None, help="sequences per pass (default: the run's)")
    parser.add_argument("--fp32", action="store_true", help="use_mixed_precision: false")
    parser.add_argument("--no-offload", action="store_true", help="offload_optimizer: false (moments on the device)")
    parser.add_argument(
        "--export-width",
        type=int,
        default=640,
        help="d_model of the exported model (8b layer split; 640: the scaled 8b, 128: a quick check; 0: skip)",
    )
    parser.add_argument(
        "--load-width",
        type=int,
        default=640,
        help="d_model of the stages whose snapshot load is measured (640: the scaled 8b, 256: a quick check; 0: skip)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    switches = {"use_mixed_precision": not args.fp32, "offload_optimizer": not args.no_offload}
    run = load_config("8b", switches) if device.type == "cuda" else load_config("8b", {**SCALED_8B, **switches})
    microbatch = args.microbatch or run.optim.microbatch_size
    results, skipped = measure_stages(run, args.stages.split(","), microbatch, device, switches)
    loads = (
        [measure_snapshot_load(width_scaled(args.load_width), stage) for stage in args.stages.split(",")]
        if args.load_width
        else []
    )
    for entry in loads:
        print(
            f"{entry['stage']} snapshot load: host peak {gib(entry['measured_peak'])} above the start, planned "
            f"{gib(entry['planned_stage_host'])} (weights, basis, moments), ratio {entry['ratio']:.3f}; largest tensor "
            f"{gib(entry['largest_tensor'])}, peak above the loaded stage {gib(entry['peak_above_loaded_stage'])}"
        )
    export = measure_export(args.export_width) if args.export_width else None
    print(
        json.dumps(
            {
                "device": str(device),
                "preset": run.name,
                "mixed_precision": run.use_mixed_precision,
                "offload_optimizer": run.offload_optimizer,
                "stages": results,
                "skipped": skipped,
                "max_ratio": max((r["ratio"] for r in results), default=None),
                "export": export,
                "snapshot_loads": loads,
                "max_load_ratio": max((entry["ratio"] for entry in loads), default=None),
            }
        )
    )


if __name__ == "__main__":
    main()
