"""``python3 agora_cli.py`` with no subcommand: the contributor client (the app, or --headless).

First run asks for what is missing (token, GPU) and saves it; see agora_client.client_config.
Exit codes (both modes) are listed in agora_client.headless.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from agora_client.client_config import ClientConfigError, Prompts, default_config_dir, resolve_client
from agora_client.headless import EXIT_INTERRUPTED, EXIT_USAGE, HeadlessPrinter
from agora_client.logs import EventLog, log_name, logs_dir
from tui.supervisor import ChildCommand, runtime_command


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headless", action="store_true", help="no app: print tagged lines (for systemd, tmux)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="headless output format")
    parser.add_argument("--swarm", metavar="URL", help="auth service of the swarm to join")
    parser.add_argument("--monitor", metavar="URL", help="points monitor of the swarm, for confirmed points")
    parser.add_argument("--gpu", metavar="N", type=int, help="GPU to contribute (NVML index)")
    parser.add_argument("--reconfigure", action="store_true", help="ask for the token and GPU again")
    parser.add_argument("--config-dir", type=Path, help="client config dir (default: $XDG_CONFIG_HOME/agora)")
    parser.add_argument("--host-port", type=int, help="TCP port peers reach the worker on (default: 49200 + GPU number)")
    parser.add_argument("--announce-addr", metavar="HOST:PORT", help="public address to announce behind a NAT or remapped port")
    parser.add_argument(
        "--runtime-cmd", metavar="CMD", help="run CMD instead of the built-in worker runtime (replays, testing)"
    )


def _command(args: argparse.Namespace, token: str, swarm: str | None, gpu: int | None, config_dir: Path) -> ChildCommand:
    if args.runtime_cmd:
        return ChildCommand(tuple(shlex.split(args.runtime_cmd)), {"HF_TOKEN": token, "PYTHONUNBUFFERED": "1"})
    return runtime_command(
        token=token, swarm=swarm, gpu=gpu, config_dir=config_dir, monitor=args.monitor,
        host_port=getattr(args, "host_port", None), announce_addr=getattr(args, "announce_addr", None),
    )


def run(args: argparse.Namespace) -> int:
    config_dir = args.config_dir or default_config_dir()
    try:
        client = resolve_client(
            config_dir, reconfigure=args.reconfigure, swarm=args.swarm, gpu=args.gpu,
            prompts=Prompts(interactive=sys.stdin.isatty()),
        )
    except ClientConfigError as error:
        print(f"agora: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, EOFError):
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    gpu = client.config.gpu_index
    command = _command(args, client.token, client.config.swarm_url, gpu, config_dir)
    event_log = EventLog(logs_dir(config_dir), log_name(gpu), secrets=[client.token])
    if args.headless:
        from tui.headless_runner import run_headless

        return asyncio.run(run_headless(command, HeadlessPrinter(sys.stdout, args.log_format), event_log=event_log))

    from tui.app import AgoraApp, BundleTarget  # Textual loads only for the app

    bundle = BundleTarget(config_dir, logs_dir(config_dir), Path.cwd(), (client.token,))
    app = AgoraApp(command, event_log=event_log, bundle=bundle)
    try:
        app.run()
    finally:
        if app.process is not None and app.process.running:  # the terminal went away mid-run
            app.process.kill()
    return app.return_code or 0
