"""`agora describe --preset 8b`: a preset's stages, parameter counts, boundary traffic, memory plan and tokenizer,
allocating nothing.

A tokenizer that cannot be fetched (a hub repo on a machine offline) is shown as not loaded; one that is
loaded but does not fit the preset (another vocabulary size, another sha256 than pinned) fails the command.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from agora_client.averaging.compression import SlicePayload
from agora_client.averaging.link_timing import butterfly_bytes, round_timing
from agora_client.config import ConfigError, ModelConfig, RunConfig, SubspaceConfig, load_config
from agora_client.data.tokenizer import TokenizerError, TokenizerUnavailable, describe_tokenizer, load_run_tokenizer
from agora_client.engine.averaging import DEFAULT_PART_SIZE_BYTES
from agora_client.model.memory import choose_layout, gib, largest_microbatch, plan_stage
from agora_client.model.stages import boundary_width, param_counts

FLOAT_BYTES = 4  # boundaries travel as float32
TOKEN_ID_BYTES = 8  # token ids travel as int64 beside every boundary, dense or compressed
# Trainable parameters per stage of the production run, as the reference documents give them
# (memory and communication: ~1.37B head, ~907M per body, ~2.73B tail).
DOCUMENTED_8B = {"head": 1.37e9, "body": 907e6, "tail": 2.73e9}
VRAM_SIZES_GIB = (24, 48, 80)  # cards the plan is shown for
HOME_CARDS_GIB = (16, 24)  # the GPUs volunteers own
HOME_RAM_GIB = (32, 64)  # their PCs' RAM, less HOME_OS_GIB for the system and desktop
HOME_OS_GIB = 4
PCIE_BYTES_PER_S = {"PCIe 4.0 x16": 31.5e9, "PCIe 4.0 x8": 15.75e9}
RTX_4090_FLOPS = 0.4 * 165e12  # dense bf16 at 40% MFU
UPLINKS_MBIT = (50, 100, 200)  # home uplinks a SPARTA round is timed for


def describe_model(config: ModelConfig) -> dict:
    """Per-stage layers and trainable parameters, and bytes per token per boundary, dense vs compressed."""
    counts = param_counts(config)
    compress = config.subspace.enabled
    stages = []
    for spec in config.stages:
        first = config.first_layer(spec.name)
        stages.append(
            {
                "name": spec.name,
                "layers": [first, first + spec.layers - 1],
                "parameters": counts[spec.name],
                "boundary_width": None if spec.name == "tail" else boundary_width(config, compress),
            }
        )
    dense = config.d_model * FLOAT_BYTES
    compressed = boundary_width(config, compress) * FLOAT_BYTES
    return {
        "d_model": config.d_model,
        "n_layers": config.n_layers,
        "vocab_size": config.vocab_size,
        "seq_len": config.seq_len,
        "subspace": compress,
        "k": config.subspace_rank if compress else None,
        "stages": stages,
        "total_parameters": sum(counts.values()),
        # the same shapes with full-rank residual writers, for comparison with the model's nominal size
        "total_parameters_unconstrained": sum(
            param_counts(config.model_copy(update={"subspace": SubspaceConfig(enabled=False)})).values()
        ),
        "bytes_per_token": {
            "dense_activation": dense,
            "compressed_activation": compressed,
            "token_id": TOKEN_ID_BYTES,
            "ratio_activation": dense / compressed,
            "ratio_forward_with_token_ids": (dense + TOKEN_ID_BYTES) / (compressed + TOKEN_ID_BYTES),
        },
    }


def documented_count(preset: str, stage: str) -> float | None:
    if preset != "8b":
        return None
    return DOCUMENTED_8B["body" if stage.startswith("body") else stage]


def describe_memory(run: RunConfig) -> list[dict]:
    """Per stage: the memory plan at the run's microbatch and the largest microbatch on common cards."""
    rows = []
    for name in run.model.stage_names:
        plan = plan_stage(run, name).to_dict()
        plan["largest_microbatch"] = {
            f"{size}GiB": largest_microbatch(run, name, size * 2**30) for size in VRAM_SIZES_GIB
        }
        plan["home"] = describe_home(run, name)
        rows.append(plan)
    return rows


def describe_home(run: RunConfig, stage: str) -> dict:
    """On each home card: the layout it takes the stage in, what that costs per microbatch and per step, and
    whether a home PC's RAM holds the host side."""
    cards = {}
    for size in HOME_CARDS_GIB:
        layout = choose_layout(run, stage, size * 2**30)
        if layout is None:
            cards[f"{size}GiB"] = None
            continue
        plan = plan_stage(run, stage, layout=layout)
        cards[f"{size}GiB"] = {
            "layout": layout,
            "gpu_peak": plan.gpu_peak,
            "host_need": plan.host_need(True),
            "pcie_per_microbatch": plan.pcie_per_microbatch,
            "pcie_per_step": plan.pcie_per_step,
            "host_traffic_per_microbatch": plan.host_traffic_per_microbatch,
            "seconds": {link: plan.seconds(RTX_4090_FLOPS, rate) for link, rate in PCIE_BYTES_PER_S.items()},
            "ram_holds": {f"{ram}GiB": plan.host_need(True) <= (ram - HOME_OS_GIB) * 2**30 for ram in HOME_RAM_GIB},
        }
    return cards


def format_home(info: dict) -> list[str]:
    links = list(PCIE_BYTES_PER_S)
    lines = [
        f"home cards ({' / '.join(str(s) for s in HOME_CARDS_GIB)} GiB): layout, GPU peak, host need, PCIe per "
        f"microbatch / step, s at {' / '.join(links)}, beside compute at 40% MFU of an RTX 4090; "
        f"PCs of {' / '.join(str(r) for r in HOME_RAM_GIB)} GiB RAM ({HOME_OS_GIB} GiB kept for the system)",
    ]
    for plan in info["memory"]:
        for card, home in plan["home"].items():
            if home is None:
                lines.append(f"{plan['stage']:<8}{card:>6}  does not fit")
                continue
            seconds = home["seconds"]
            transfer = " / ".join(f"{seconds[link]['pcie_microbatch']:.2f}" for link in links)
            ram = ", ".join(f"{size}: {'yes' if holds else 'no'}" for size, holds in home["ram_holds"].items())
            stage, layout, peak, need = plan["stage"], home["layout"], gib(home["gpu_peak"]), gib(home["host_need"])
            moved = f"{home['pcie_per_microbatch'] / 1e9:>7.2f} / {home['pcie_per_step'] / 1e9:.2f} GB"
            compute = f"{seconds[links[0]]['compute']:.2f} s compute"
            added = f"host add {home['host_traffic_per_microbatch'] / 1e9:.1f} GB/microbatch"
            lines.append(
                f"{stage:<8}{card:>6}  {layout:<8}{peak:>11}{need:>11}{moved}   {transfer} s vs {compute}; {added}; "
                f"RAM {ram}"
            )
    return lines


def describe_sparta(run: RunConfig, counts: dict[str, int]) -> list[dict]:
    """Per stage: what one SPARTA round moves per peer (2 peers, the run's payload) and how long that takes on
    common uplinks."""
    rows = []
    for name, parameters in counts.items():
        seconds = {f"{mbit}Mbit": round(sparta_round(run, parameters, mbit * 1e6 / 8)[1], 1) for mbit in UPLINKS_MBIT}
        rows.append(
            {
                "stage": name,
                "payload": run.sparta.payload,
                "bytes_each_way": sparta_round(run, parameters, 1.0)[0],
                "seconds": seconds,
            }
        )
    return rows


def sparta_round(run: RunConfig, parameters: int, uplink: float) -> tuple[float, float]:
    """(bytes each way per peer, expected seconds) of one SPARTA round of a stage of ``parameters`` between 2 peers
    whose slower link moves ``uplink`` bytes/s, in the run's payload."""
    moved = parameters * run.sparta.fraction * SlicePayload(run.sparta.payload, torch.empty(1)).bytes_per_value
    timing = round_timing(moved, 2, uplink, DEFAULT_PART_SIZE_BYTES, run.sparta)
    return butterfly_bytes(moved, 2), timing.expected_s


def describe_run(run: RunConfig) -> dict:
    info = describe_model(run.model)
    for stage in info["stages"]:
        stage["documented"] = documented_count(run.name, stage["name"])
    info["use_mixed_precision"], info["offload_optimizer"] = run.use_mixed_precision, run.offload_optimizer
    info["memory"] = describe_memory(run)
    info["sparta"] = describe_sparta(run, {stage["name"]: stage["parameters"] for stage in info["stages"]})
    return info


def format_sparta(info: dict) -> list[str]:
    payload = info["sparta"][0]["payload"] if info["sparta"] else "fp32"
    lines = [
        f"SPARTA: one round per peer (2 peers, {payload} payload) and how long it takes on an uplink of",
        f"{'stage':<8}{'MB each way':>12}" + "".join(f"{f'{mbit} Mbit/s':>12}" for mbit in UPLINKS_MBIT),
    ]
    for row in info["sparta"]:
        times = "".join(f"{row['seconds'][f'{mbit}Mbit']:>11.1f}s" for mbit in UPLINKS_MBIT)
        lines.append(f"{row['stage']:<8}{row['bytes_each_way'] / 1e6:>12,.0f}{times}")
    return lines


def describe_run_tokenizer(run: RunConfig) -> dict:
    """The run's tokenizer as loaded, or its source and why it could not be loaded.

    Raises TokenizerError if it does not fit the model."""
    try:
        return describe_tokenizer(load_run_tokenizer(run))
    except TokenizerUnavailable as error:
        return {"source": run.tokenizer.source, "unavailable": str(error)}


def format_tokenizer(tokenizer: dict) -> str:
    if "unavailable" in tokenizer:
        return f"tokenizer {tokenizer['source']}: not loaded ({tokenizer['unavailable']})"
    eos = "a blank line ends a document" if tokenizer["eos_token"] is None else f"eos {tokenizer['eos_token']}"
    return (
        f"tokenizer {tokenizer['source']}: sha256 {tokenizer['sha256'][:16]}, vocab {tokenizer['vocab_size']:,}, {eos}"
    )


def format_memory(info: dict) -> list[str]:
    precision = "bf16 autocast" if info["use_mixed_precision"] else "fp32"
    moments = "host (offloaded)" if info["offload_optimizer"] else "GPU"
    sizes = " / ".join(str(size) for size in VRAM_SIZES_GIB)
    lines = [
        f"memory plan ({precision}, AdamW moments on {moments}; GPU peak = during a recomputing backward):",
        f"{'stage':<8}{'mb':>3}{'weights':>12}{'grads':>12}{'saved act':>12}{'backward':>12}{'GPU peak':>12}"
        f"{'host':>12}{'+ writing':>12}   largest microbatch on {sizes} GiB",
    ]
    for plan in info["memory"]:
        largest = " / ".join(str(count) for count in plan["largest_microbatch"].values())
        lines.append(
            f"{plan['stage']:<8}{plan['microbatch']:>3}{gib(plan['weights']):>12}{gib(plan['gradients']):>12}"
            f"{gib(plan['saved_activations']):>12}{gib(plan['backward_transient']):>12}{gib(plan['gpu_peak']):>12}"
            f"{gib(plan['host']):>12}{gib(plan['snapshot']):>12}   {largest}"
        )
    lines += [
        "  host = AdamW moments (when offloaded) + SPARTA averaging buffers; a card also keeps 1 GiB for CUDA itself",
        "  + writing = the host copy of weights and moments a worker that publishes snapshots or checkpoints keeps",
    ]
    return lines


def format_description(name: str, info: dict) -> str:
    subspace = f"on, k = {info['k']}" if info["subspace"] else "off"
    lines = [
        f"preset {name}: d_model {info['d_model']}, {info['n_layers']} layers, vocab {info['vocab_size']}, "
        f"seq_len {info['seq_len']}, subspace {subspace}",
        f"{'stage':<8}{'layers':<14}{'parameters':>16}{'documents':>12}{'ratio':>7}   boundary sent",
    ]
    for stage in info["stages"]:
        first, last = stage["layers"]
        layers = f"{first}-{last} ({last - first + 1})"
        width = stage["boundary_width"]
        sent = "loss only" if width is None else f"{width} floats/token ({'k' if info['subspace'] else 'd'})"
        documented = stage.get("documented")
        reference = f"{documented / 1e9:>11.2f}B{stage['parameters'] / documented:>7.3f}" if documented else f"{'':>19}"
        lines.append(f"{stage['name']:<8}{layers:<14}{stage['parameters']:>16,}{reference}   {sent}")
    lines.append(f"{'total':<8}{info['n_layers']:<14}{info['total_parameters']:>16,}")
    if info["subspace"]:
        lines.append(f"{'':<22}{info['total_parameters_unconstrained']:>16,}   without the subspace constraint")
    per_token = info["bytes_per_token"]
    lines.append(
        f"bytes per token per boundary: dense {per_token['dense_activation']:,} B, "
        f"compressed {per_token['compressed_activation']:,} B each way "
        f"(x{per_token['ratio_activation']:.1f}); plus {per_token['token_id']} B of token id forward "
        f"(x{per_token['ratio_forward_with_token_ids']:.1f} with it)"
    )
    if "memory" in info:
        lines += format_memory(info) + format_home(info)
    if "sparta" in info:
        lines += format_sparta(info)
    if "tokenizer" in info:
        lines.append(format_tokenizer(info["tokenizer"]))
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="preset name (tiny, 8b) or path to a run config YAML")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.preset)
        tokenizer = describe_run_tokenizer(config)
    except (ConfigError, TokenizerError) as error:
        print(error, file=sys.stderr)
        return 2
    info = {**describe_run(config), "tokenizer": tokenizer}
    print(json.dumps(info) if args.json else format_description(config.name, info))
    return 0
