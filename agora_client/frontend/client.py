"""``python3 agora_cli.py`` with no subcommand: the contributor client, up to the choice of front end.

First run asks for what is missing (token, swarm, GPU) and saves it; see agora_client.client_config.
The result is a :class:`ClientSession` (what to run, where to log); ``agora_cli.py`` alone decides
which front end (the app, or the headless printer) runs it. Exit codes:
:mod:`agora_client.frontend.exit_codes`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agora_client.client_config import ClientConfigError, Prompts, default_config_dir, resolve_client
from agora_client.frontend.exit_codes import EXIT_INTERRUPTED, EXIT_USAGE
from agora_client.frontend.notify import NOTIFY_TIMEOUT_S
from agora_client.frontend.restart import RESTART_MODES, RestartMode, RestartPolicy, restart_help
from agora_client.frontend.supervisor import ChildCommand, runtime_command
from agora_client.logs import EventLog, log_name, logs_dir
from agora_client.system.gpu_yield import configure_yield, yield_argv
from agora_client.system.pause_control import PauseControlError, socket_path, toggle
from agora_client.token_scope import TokenRefused, check_token_scope
from agora_client.upload_cap import MAX_UPLOAD_HELP, upload_cap_argument


@dataclass(frozen=True)
class ClientSession:
    """Everything a front end needs to run the contributor's runtime."""

    command: ChildCommand
    config_dir: Path
    gpu: int | None
    headless: bool = False
    log_format: str = "text"
    secrets: tuple[str, ...] = field(default=(), repr=False)
    restart: RestartMode = "never"
    notify_cmd: tuple[str, ...] = ()  # the notify command's argv (the message comes last)

    @property
    def logs_dir(self) -> Path:
        return logs_dir(self.config_dir)

    def event_log(self) -> EventLog:
        return EventLog(self.logs_dir, log_name(self.gpu), secrets=self.secrets)

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.restart)

    def toggle_pause(self) -> str:
        """Pause the runtime, or resume it when paused (the app's key, as ``agora pause`` / ``agora resume``); what
        it answered, or why it could not be reached."""
        try:
            answer = toggle(socket_path(self.config_dir, self.gpu))
        except PauseControlError as error:
            return str(error)
        return answer.message if answer is not None else "the worker runtime does not listen for agora pause"


FrontEnd = Callable[[ClientSession], int]
DEFAULT_RETRY_EVERY_S = 30.0  # seconds between join attempts while the swarm cannot reach the worker


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _command_line(text: str) -> str:
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a command line ({error}); quote it as a shell would"
        ) from None
    if not words:
        raise argparse.ArgumentTypeError(
            'the notify command is empty: give a program, e.g. "curl -s https://ntfy.sh/TOPIC -d"'
        )
    return text


def configure_supervision(parser: argparse.ArgumentParser) -> None:
    """--restart and --notify-cmd.

    What the front end does when the runtime crashes or something worth hearing happens."""
    parser.add_argument("--restart", choices=RESTART_MODES, default="never", help=restart_help())
    parser.add_argument(
        "--notify-cmd",
        metavar="CMD",
        type=_command_line,
        help="run CMD (split as a shell would, run without one) with a short message as its last argument, also in "
        "$AGORA_NOTIFY_MESSAGE (kind in $AGORA_NOTIFY_KIND), when the runtime drops out, is refused or banned, "
        "runs out of memory, or leaves the queue for Active; never with the token; killed after "
        f"{NOTIFY_TIMEOUT_S:.0f}s",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--headless", action="store_true", help="no app: print tagged lines (for systemd, tmux)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="headless output format")
    parser.add_argument("--swarm", metavar="URL", help="auth service of the swarm to join")
    parser.add_argument("--monitor", metavar="URL", help="points monitor of the swarm, for confirmed points")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--gpu", metavar="N", type=int, help="GPU to contribute (NVML index)")
    device.add_argument("--cpu", action="store_true", help="run the worker on the CPU: the demo and tests only")
    parser.add_argument("--reconfigure", action="store_true", help="ask for the token, swarm and GPU again")
    _add_token_arguments(parser)
    parser.add_argument("--config-dir", type=Path, help="client config dir (default: $XDG_CONFIG_HOME/agora)")
    _add_network_arguments(parser)
    configure_yield(parser)
    configure_supervision(parser)
    parser.add_argument(
        "--runtime-cmd", metavar="CMD", help="run CMD instead of the built-in worker runtime (replays, testing)"
    )


def _add_token_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--use-hf-login-token",
        action="store_true",
        help="use the token saved by `hf auth login` without asking (where nobody can be asked: headless)",
    )
    parser.add_argument(
        "--allow-write-token",
        action="store_true",
        help="send a token that can write to the swarm all the same (a read-only token is all a swarm needs)",
    )


def _add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-port", type=int, help="TCP port peers reach the worker on (default: 49200 + GPU number)"
    )
    parser.add_argument(
        "--announce-addr", metavar="HOST:PORT", help="public address to announce behind a NAT or remapped port"
    )
    parser.add_argument(
        "--no-port-mapping",
        dest="port_mapping",
        action="store_false",
        help="do not ask the home router to forward the worker's port (UPnP or NAT-PMP)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow plain http:// to a swarm outside this machine and the private networks "
        "(your token then crosses the internet in clear text)",
    )
    parser.add_argument(
        "--ca-cert",
        type=Path,
        metavar="PEM",
        help="also trust this CA certificate for the swarm's https:// services (a swarm's own CA; "
        "SSL_CERT_FILE works too, in place of the usual CAs)",
    )
    parser.add_argument(
        "--retry-every",
        metavar="SECONDS",
        type=_positive_seconds,
        default=DEFAULT_RETRY_EVERY_S,
        help="while the swarm cannot reach this worker, ask again this often (default: "
        f"{DEFAULT_RETRY_EVERY_S:.0f}; r in the app: now)",
    )
    parser.add_argument(
        "--max-upload-mbit",
        metavar="N",
        type=upload_cap_argument,
        help=f"{MAX_UPLOAD_HELP} (saved for the next runs)",
    )


def _command(
    args: argparse.Namespace, token: str, swarm: str, gpu: int | None, config_dir: Path, max_upload_mbit: float
) -> ChildCommand:
    if args.runtime_cmd:
        return ChildCommand(tuple(shlex.split(args.runtime_cmd)), {"HF_TOKEN": token, "PYTHONUNBUFFERED": "1"})
    return runtime_command(
        token=token,
        swarm=swarm,
        gpu=gpu,
        cpu=args.cpu,
        config_dir=config_dir,
        monitor=args.monitor,
        host_port=args.host_port,
        announce_addr=args.announce_addr,
        port_mapping=args.port_mapping,
        retry_every=args.retry_every,
        insecure=args.insecure,
        ca_cert=args.ca_cert,
        yield_args=tuple(yield_argv(args)),
        max_upload_mbit=max_upload_mbit,
    )


def prepare(args: argparse.Namespace) -> ClientSession | int:
    """The session to run, or the exit code when the config cannot be completed."""
    config_dir = args.config_dir or default_config_dir()
    try:
        client = resolve_client(
            config_dir,
            reconfigure=args.reconfigure,
            swarm=args.swarm,
            gpu=args.gpu,
            use_gpu=not args.cpu,
            prompts=Prompts(interactive=sys.stdin.isatty()),
            need_swarm=not args.runtime_cmd,
            use_login_token=args.use_hf_login_token,
            max_upload_mbit=args.max_upload_mbit,
        )
        if not args.runtime_cmd:  # before the first join: the token goes nowhere Hugging Face says it may write
            check_token_scope(client.token, allow_write=args.allow_write_token)
    except TokenRefused as error:
        print(f"agora: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ClientConfigError as error:
        print(f"agora: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (KeyboardInterrupt, EOFError):
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    gpu = client.config.gpu_index
    return ClientSession(
        command=_command(
            args, client.token, client.config.swarm_url or "", gpu, config_dir, client.config.max_upload_mbit
        ),
        config_dir=Path(config_dir),
        gpu=gpu,
        headless=args.headless,
        log_format=args.log_format,
        secrets=(client.token,),
        restart=args.restart,
        notify_cmd=tuple(shlex.split(args.notify_cmd or "")),
    )


def run(args: argparse.Namespace, front_end: FrontEnd) -> int:
    session = prepare(args)
    return session if isinstance(session, int) else front_end(session)
