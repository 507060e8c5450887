"""Does publishing snapshots stall serving? (issue 24)

One open body1 worker (``agora worker --device cpu``, its own process) of a preset whose body1 holds about
``--body-params`` parameters serves a steady stream of forward + backward requests from this process (one
at a time, as a trainer's microbatches arrive). The same stream runs twice, side by side in one run: first
against a worker that publishes nothing, then against one started with ``--publish-snapshots DIR
--publish-every N``. An epoch is every ``--epoch-requests`` backward passes, so a snapshot falls due every
N such epochs.

Figures: requests served and p50 / p99 / max request latency of each phase, ``p99_ratio`` (on / off,
target <= 1.2) and ``stage_params``. The locks: each publication's log line says how long its host copy held
the state lock (``publication_lock_hold_max_s``, the longest), which only steps wait for; the worker says at
exit how long a request waited at most for the stage lock (``request_lock_wait_max_s``, each phase);
``max_latency_excess_s`` (max on - max off) is what requests saw.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import yaml
from _widened import widened_config  # noqa: E402  (bench/ is on sys.path: this script's own folder)
from hivemind.compression import serialize_torch_tensor

from agora_client.config import load_config
from agora_client.discovery.dht import connect_dht
from agora_client.engine.expert_calls import call_expert, close_replica, replicate_p2p, server_stub
from agora_client.model import build_stage
from agora_client.swarm.processes import CLI

STAGE, UID = "body1", "body1.0.0"
BODY_LAYERS = 4
LOCK_HOLD = re.compile(r"copied in ([0-9.]+) s \(steps wait for the copy")
LOCK_WAIT = re.compile(r"the longest a request waited for the stage lock: ([0-9.]+) s")


def preset(body_params: int, epoch_requests: int, batch: int) -> dict:
    """tiny, with body1 widened to about ``body_params`` (bench/_widened.py), ``batch`` sequences per request and
    an epoch every ``epoch_requests`` backward passes."""
    data = widened_config(body_params, BODY_LAYERS).model_dump(mode="json")
    data["optim"].update(microbatch_size=batch, target_batch_size=batch * epoch_requests)
    return data


def stage_params(preset_path: Path) -> int:
    module = build_stage(load_config(str(preset_path)).model, STAGE, seed=0, device="meta")
    return sum(parameter.numel() for parameter in module.parameters())


def start_worker(seeds: list[str], preset_path: Path, run_dir: Path, name: str, publish: list[str]) -> subprocess.Popen:
    args = [
        *CLI,
        "worker",
        "--stage",
        STAGE,
        "--index",
        "0",
        "--seeds",
        *seeds,
        "--preset",
        str(preset_path),
        "--device",
        "cpu",
        "--events",
        str(run_dir / f"{name}.events.jsonl"),
        "--open",  # a bench's own swarm: no auth service
        *publish,
    ]
    output = run_dir / f"{name}.log"
    with open(output, "w") as log:
        worker = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while "ready on peer" not in output.read_text():
        if worker.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            raise RuntimeError(f"the worker was not ready (exit code {worker.poll()}); its output is in {output}")
        time.sleep(0.5)
    return worker


def serve_stream(p2p, peer_id: str, preset_path: Path, batch: int, seconds: float, warmup: int) -> list[float]:
    """Forward then backward, one request at a time, for ``seconds``; the latency of each request after the warmup."""
    module_inputs = build_stage(load_config(str(preset_path)).model, STAGE, seed=0, device="meta").example_inputs(batch)
    hidden = torch.randn(module_inputs[0].shape)
    tokens = torch.randint(0, 256, tuple(module_inputs[1].shape))
    forward = [serialize_torch_tensor(t) for t in (hidden, tokens)]
    backward = [*forward, serialize_torch_tensor(torch.randn(hidden.shape) * 1e-3)]
    stub, latencies, deadline = server_stub(p2p, peer_id), [], time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        for kind, tensors in (("forward", forward), ("backward", backward)):
            payload = sum(len(t.buffer) for t in tensors)
            started = time.monotonic()
            call_expert(stub, kind, UID, tensors, b"", payload_bytes=payload, timeout=600)
            sent += 1
            if sent > warmup:
                latencies.append(time.monotonic() - started)
    return latencies


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def run_phase(name: str, seed, p2p, args, preset_path: Path, run_dir: Path, publish: list[str]) -> dict:
    print(f"[{name}] starting the worker", flush=True)
    events = run_dir / f"{name}.events.jsonl"
    worker = start_worker([str(a) for a in seed.get_visible_maddrs()], preset_path, run_dir, name, publish)
    try:
        peer_id = next(
            json.loads(line)["peer_id"] for line in events.read_text().splitlines() if '"kind":"stage"' in line
        )
        latencies = serve_stream(p2p, peer_id, preset_path, args.batch, args.seconds, args.warmup)
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    log = events.read_text()
    holds = [float(hold) for hold in LOCK_HOLD.findall(log)]
    figures = {
        "requests": len(latencies),
        "p50_s": round(quantile(latencies, 0.5), 3),
        "p99_s": round(quantile(latencies, 0.99), 3),
        "max_s": round(max(latencies), 3),
        "publications": len(holds),
        "skipped_runs": log.count("skipped the body1 snapshot"),
        "publication_lock_hold_max_s": round(max(holds), 3) if holds else None,
        "request_lock_wait_max_s": next((float(wait) for wait in LOCK_WAIT.findall(log)), None),
    }
    print(f"[{name}] {figures}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--body-params", type=int, default=300_000_000, help="body1's size in parameters (300M: the issue's)"
    )
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each phase's request stream")
    parser.add_argument("--publish-every", type=int, default=3, help="epochs between snapshots in the publishing phase")
    parser.add_argument("--epoch-requests", type=int, default=2, help="backward passes per stage epoch")
    parser.add_argument("--batch", type=int, default=1, help="sequences per request")
    parser.add_argument("--warmup", type=int, default=4, help="requests of each phase not timed (the first ones)")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the worker logs and snapshots here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="publish-stall-") as temporary:
        run_dir = args.run_dir or Path(temporary)
        run_dir.mkdir(parents=True, exist_ok=True)
        preset_path = run_dir / "publish_stall.yaml"
        preset_path.write_text(yaml.safe_dump(preset(args.body_params, args.epoch_requests, args.batch)))
        params = stage_params(preset_path)
        print(f"body1 holds {params / 1e6:.1f}M parameters; {args.seconds:.0f} s per phase", flush=True)
        seed = connect_dht([])
        p2p = replicate_p2p(seed)
        try:
            off = run_phase("off", seed, p2p, args, preset_path, run_dir, [])
            publish = ["--publish-snapshots", str(run_dir / "snapshots"), "--publish-every", str(args.publish_every)]
            on = run_phase("on", seed, p2p, args, preset_path, run_dir, publish)
        finally:
            close_replica(p2p)
            seed.shutdown()
    print(
        json.dumps(
            {
                "p99_ratio": round(on["p99_s"] / off["p99_s"], 3),
                "stage_params": params,
                "off": off,
                "on": on,
                "publication_lock_hold_max_s": on["publication_lock_hold_max_s"],
                "max_latency_excess_s": round(on["max_s"] - off["max_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
