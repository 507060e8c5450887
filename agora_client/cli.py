"""`agora` / `python3 agora_cli.py`: the contributor app by default, and every role as a subcommand.

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so the app starts without loading torch.
The front end (the app or the headless printer) is chosen by the entry point (``agora_cli.py``),
which passes it in as ``front_end``; commands that run the client (``demo``) find it in
``args.front_end``. This package never imports a front end.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from agora_client.frontend.client import FrontEnd
from agora_client.system.cuda_allocator import use_expandable_segments
from agora_client.system.lifetime import exit_process

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("agora_client.swarm.demo", "start the local tiny swarm and join it with the app"),
    "swarm": ("agora_client.swarm.launcher", "run a whole local swarm: 2 seeds, trainer, 2 workers per stage"),
    "seed": ("agora_client.discovery.seed", "run a DHT bootstrap peer"),
    "worker": ("agora_client.worker.main", "host one pipeline stage"),
    "trainer": ("agora_client.trainer.main", "route microbatches through the pipeline (CPU only)"),
    "auth": ("agora_client.auth.main", "run the auth service"),
    "trainer-credential": ("agora_client.auth.credential_cli", "add, revoke or list trainer credentials (auth host)"),
    "monitor": ("agora_client.monitor.main", "scrape metrics, keep points, serve the leaderboard"),
    "leaderboard": ("agora_client.monitor.leaderboard_cli", "print the leaderboard as a table"),
    "describe": ("agora_client.describe", "show a preset's stages and parameter counts"),
    "runtime": ("agora_client.runtime", "the worker runtime the app supervises; writes events to stdout"),
    "pause": ("agora_client.system.pause_cli", "pause the running worker runtime from another terminal"),
    "resume": ("agora_client.system.resume_cli", "resume the worker runtime agora pause paused"),
    "export-logs": ("agora_client.system.bundle_cli", "write a support bundle (zip) for a ticket"),
    "checkpoints": ("agora_client.checkpoints.list_cli", "list consistent checkpoint sets: per-stage times, loss"),
    "export": ("agora_client.checkpoints.export", "write a checkpoint set as a Hugging Face OLMo2 model directory"),
    "tokenizer": ("agora_client.data.tokenizer_training", "train a byte-level BPE tokenizer on a data source"),
    "relay": ("agora_client.relay.main", "run a relay for workers no port mapping can open"),
    "snapshot-server": (
        "agora_client.snapshots.server_cli",
        "serve a snapshot store directory over HTTP(S) with sendfile (Range, If-Range, HEAD, ETag)",
    ),
    "deploy": (
        "agora_client.deploy.cli",
        "start, stop, write systemd units for or firewall this host's roles from a deploy file",
    ),
}
# Commands that run hivemind peers: they leave with exit_process once they have stopped in order.
ENGINE_COMMANDS = frozenset({"demo", "swarm", "seed", "worker", "trainer", "monitor", "runtime"})
CLIENT_MODULE = "agora_client.frontend.client"  # no subcommand: the contributor client


def _load(module_name: str):
    return importlib.import_module(module_name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agora", description="Agora: train large models on volunteers' GPUs.")
    _load(CLIENT_MODULE).configure(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        # configure() is resolved lazily: only the chosen command's module is imported.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _no_front_end(session) -> int:
    print("agora: this entry point has no front end; run python3 agora_cli.py", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None, front_end: FrontEnd = _no_front_end) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in COMMANDS:
        if command in ENGINE_COMMANDS:
            use_expandable_segments()  # before any CUDA allocation; the processes these start inherit it
        module_name, help_text = COMMANDS[command]
        module = _load(module_name)
        parser = argparse.ArgumentParser(prog=f"agora {command}", description=help_text)
        module.configure(parser)
        parser.set_defaults(front_end=front_end)
        rest = argv[argv.index(command) + 1 :]
        code = int(module.run(parser.parse_args(rest)) or 0)
        if command in ENGINE_COMMANDS:
            exit_process(code)  # skips the teardown where hivemind's leftovers print errors (P2P.__del__)
        return code
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(_load(CLIENT_MODULE).run(args, front_end) or 0)
