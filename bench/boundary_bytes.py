"""Bytes per token per stage boundary, dense against Subspace Networks compression.

- tiny: measured from the serialized RPC payloads of a real running swarm (one worker per stage,
  one trainer), once with the preset's subspace compression and once with it disabled, one after
  the other in the same run.
- 8b: a real [1, 4096, 5120] boundary (and its [1, 4096, 51] compressed form) run through the
  stage code on the meta device and serialized with hivemind's serializer, forward and backward.

Usage: python bench/boundary_bytes.py [--microbatches 12]
The last line is one JSON object with the figures and the ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from importlib import resources
from pathlib import Path

import yaml

from agora_client.config import load_config
from agora_client.model import serialized_boundary_bytes
from agora_client.swarm.launcher import LocalSwarm, SwarmOptions

BOUNDARY_KEYS = ("body1.forward_request", "body1.backward_reply")  # what crosses head->body1, both ways


def measure_swarm(preset_path: Path, microbatches: int, run_dir: Path) -> dict[str, float]:
    options = SwarmOptions(
        preset=str(preset_path),
        workers_per_stage=1,
        trainers=1,
        run_dir=run_dir,
        report_every=1000.0,
        trainer_args=("--max-microbatches", str(microbatches)),
    )
    with LocalSwarm(options) as swarm:
        trainer = swarm.trainers[0]
        trainer.wait_for("[TRAINER] stopped", timeout=600)
        line = [text for text in trainer.lines() if text.startswith("[TRAFFIC]")][-1]
    traffic = json.loads(line.split(" ", 1)[1])
    return {key: traffic[key] for key in BOUNDARY_KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=12)
    args = parser.parse_args()

    tiny = yaml.safe_load((resources.files("agora_client") / "presets" / "tiny.yaml").read_text())
    dense = {**tiny, "model": {**tiny["model"], "subspace": {**tiny["model"]["subspace"], "enabled": False}}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tiny.yaml").write_text(yaml.safe_dump(tiny))
        (root / "dense.yaml").write_text(yaml.safe_dump(dense))
        compressed_tiny = measure_swarm(root / "tiny.yaml", args.microbatches, root / "compressed")
        dense_tiny = measure_swarm(root / "dense.yaml", args.microbatches, root / "dense")

    config_8b = load_config("8b").model
    big = serialized_boundary_bytes(config_8b, "head", 1, config_8b.seq_len, device="meta")

    figures = {
        "tiny_bytes_per_token": {"dense": dense_tiny, "compressed": compressed_tiny},
        "tiny_ratio_forward": round(dense_tiny[BOUNDARY_KEYS[0]] / compressed_tiny[BOUNDARY_KEYS[0]], 2),
        "tiny_ratio_backward": round(dense_tiny[BOUNDARY_KEYS[1]] / compressed_tiny[BOUNDARY_KEYS[1]], 2),
        "8b": big,
    }
    for name, per_token in figures["tiny_bytes_per_token"].items():
        print(
            f"tiny {name:10s}: forward {per_token[BOUNDARY_KEYS[0]]:.1f} B/token, backward "
            f"{per_token[BOUNDARY_KEYS[1]]:.1f} B/token"
        )
    print(f"tiny ratio     : forward x{figures['tiny_ratio_forward']}, backward x{figures['tiny_ratio_backward']}")
    print(f"8b (head boundary, [1, {config_8b.seq_len}, d]): {json.dumps(big)}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
