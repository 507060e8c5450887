"""Seconds a contributor holding a large stage takes to stop, and how soon its slot is free (issue 24).

A real auth service (token file identities) and a seed DHT run in this process; the contributor is the
real runtime (``agora runtime --cpu``), started and stopped by the front ends' supervisor. The run is the
tiny preset with ``body1`` widened to about ``--stage-params`` parameters (``--layers`` layers, d_model
chosen to match, built with seeded weights: no snapshot to download), and body1 is the only stage the
auth service assigns. Once the worker serves its stage (sync phase 1), the supervisor stops it as the
app's ``q`` does, while this process polls the auth service for the slot.

Figures: ``stop_s`` (stop request to the runtime's exit, supervisor escalation included), ``slot_freed_s``
(stop request to the auth service counting the slot free), ``stop_over_target`` (``stop_s`` / 10 s, the
stop the runtime promises; target <= 1), the runtime's exit code (0: it stopped by itself, before the
supervisor's SIGTERM) and ``stage_params``.

Usage: python bench/stop_time.py [--stage-params 300e6] [--layers 4]
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import hivemind

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository
from _widened import widened_config  # noqa: E402  (bench/ is on sys.path: this script's own folder)

from agora_client.auth import (  # noqa: E402
    AdmissionPolicy,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    swarm_status,
    write_demo_token_file,
)
from agora_client.auth.run_description import TokenizerSummary, describe_run  # noqa: E402
from agora_client.data.tokenizer import load_run_tokenizer  # noqa: E402
from agora_client.frontend.stream import EventLine, StderrLine, read_runtime  # noqa: E402
from agora_client.frontend.supervisor import RUNTIME_STOP_S, RuntimeProcess, runtime_command  # noqa: E402
from agora_client.model.stages import param_counts  # noqa: E402

STAGE = "body1"
SERVING_TIMEOUT_S = 900.0  # building a 300M stage on a loaded CPU takes minutes


async def measure(auth_url: str, token: str, config_dir: Path) -> dict:
    """Start the runtime, wait until it serves its stage, stop it; the stop's figures."""
    process = RuntimeProcess(runtime_command(token=token, swarm=auth_url, cpu=True, config_dir=config_dir, host_port=0))
    await process.start()
    serving, ended = asyncio.Event(), asyncio.Event()
    notable: list[str] = []

    async def relay() -> None:
        async for item in read_runtime(process):
            if isinstance(item, EventLine):
                event = item.event
                if event.kind == "sync" and event.phase == "sync1":
                    serving.set()
                elif event.kind in ("error", "exit") or (event.kind == "log" and event.level in ("warning", "error")):
                    notable.append(event.model_dump_json())
                    print(notable[-1], flush=True)
            elif isinstance(item, StderrLine):
                print(f"stderr: {item.text}", flush=True)
        ended.set()

    reader = asyncio.create_task(relay())
    started = time.monotonic()
    await asyncio.wait(
        [asyncio.create_task(serving.wait()), asyncio.create_task(ended.wait())],
        timeout=SERVING_TIMEOUT_S,
        return_when=asyncio.FIRST_COMPLETED,
    )
    if not serving.is_set():
        await process.stop()
        raise SystemExit(f"the runtime never served its stage within {SERVING_TIMEOUT_S:.0f}s: {notable[-3:]}")
    print(f"serving {STAGE} after {time.monotonic() - started:.1f}s; stopping it", flush=True)
    assert swarm_status(auth_url)["occupied"] == 1, "the serving contributor holds no slot"
    slot_freed = asyncio.create_task(until_slot_free(auth_url, time.monotonic()))
    stop_started = time.monotonic()
    code = await process.stop()
    stop_s = time.monotonic() - stop_started
    await asyncio.wait_for(reader, 30)
    return {"stop_s": round(stop_s, 2), "slot_freed_s": await asyncio.wait_for(slot_freed, 30), "exit_code": code}


async def until_slot_free(auth_url: str, since: float) -> float:
    while (await asyncio.to_thread(swarm_status, auth_url))["occupied"]:
        await asyncio.sleep(0.05)
    return round(time.monotonic() - since, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage-params", type=float, default=300e6, help="about this many parameters in body1")
    parser.add_argument("--layers", type=int, default=4, help="body1's layers")
    args = parser.parse_args()
    config = widened_config(args.stage_params, args.layers)
    stage_params = param_counts(config.model)[STAGE]
    print(
        f"{STAGE}: {stage_params / 1e6:.1f}M parameters (d_model {config.model.d_model}, {args.layers} layers)",
        flush=True,
    )
    seed = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        seeds = tuple(str(maddr) for maddr in seed.get_visible_maddrs())
        tokenizer = load_run_tokenizer(config)  # the client checks the served tokenizer before it joins
        run = describe_run(config, seeds, None, None, TokenizerSummary.of(tokenizer))
        with tempfile.TemporaryDirectory(prefix="stop_time_") as folder:
            token = write_demo_token_file(Path(folder) / "tokens.json", "alice")
            settings = ServiceSettings(
                policy=AdmissionPolicy(stages=(STAGE,), pacing_s=0.0),
                seeds=seeds,
                run=run,
                tokenizer_json=tokenizer.content,
            )
            service = AuthService(settings, TokenFileIdentity(Path(folder) / "tokens.json"), Path(folder) / "state")
            with AuthServer(service) as auth:
                figures = asyncio.run(measure(auth.url, token, Path(folder) / "client"))
    finally:
        seed.shutdown()
    figures.update(
        stage_params=stage_params,
        target_s=RUNTIME_STOP_S,
        stop_over_target=round(figures["stop_s"] / RUNTIME_STOP_S, 3),
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
