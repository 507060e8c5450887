"""`agora runtime`: the contributor's worker runtime, supervised by the app or the headless printer.

It reads the run description from the swarm's auth service (``GET /v1/run``: the run config, seeds,
snapshot and monitor URLs; no preset is assumed), runs the preflight checks, opens the worker's port,
authorizes (token from ``HF_TOKEN``; the service dials the port back, and while it cannot, the
runtime shows the diagnosis and retries every ``--retry-every`` seconds or at once on SIGUSR1), downloads the assigned
stage's snapshot and builds the stage (both already while queued), waits in the join queue, then runs
a worker that passes through sync phases 1 and 2 to active. Plain http:// to a swarm, monitor or snapshot store
that is neither on this machine nor on a private network is refused unless ``--insecure``; ``--ca-cert`` trusts
a swarm's own certificate authority besides the usual ones. Everything it has to say goes to stdout as events, one JSON
object per line (agora_client/events.py). SIGINT or SIGTERM stop it gracefully. ``--yield`` and ``--active-hours``
give the GPU back to its owner (agora_client/system/gpu_yield.py): the worker drains and keeps its slot for
``--yield-grace``; past it, the worker leaves and joins again once the GPU is free. ``agora pause`` (from another
terminal, through a socket in the config dir: agora_client/system/pause_control.py) yields the same way until
``agora resume``.

Exit codes: agora_client.frontend.exit_codes (0 stopped on request, 1 runtime error, 2 bad usage
or config, 3 rejected by the swarm). The reason for a nonzero code is said once: by the event that
reported the failure (an auth event, say), else by one error event.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from agora_client.events import STARTING, ErrorEvent, EventWriter, ExitEvent
from agora_client.frontend.exit_codes import EXIT_ERROR, EXIT_OK, EXIT_REJECTED, EXIT_USAGE
from agora_client.system.gpu_yield import configure_yield, policy_of
from agora_client.system.lifetime import on_signals, stop_on_signals
from agora_client.system.log_events import logs_to_events
from agora_client.upload_cap import MAX_UPLOAD_HELP, upload_cap_argument

if TYPE_CHECKING:
    from agora_client.auth.run_description import RunDescription
    from agora_client.joining.contributor import Contributor
    from agora_client.system.gpu_yield import YieldPolicy
    from agora_client.system.pause_control import PauseServer


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm", required=True, help="URL of the swarm's auth service")
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--gpu", type=int, default=None, help="GPU number as nvidia-smi shows it")
    device.add_argument("--cpu", action="store_true", help="run the worker on the CPU: the demo and tests only")
    parser.add_argument("--config-dir", type=Path, default=None, help="where identity keys and downloads live")
    parser.add_argument("--monitor", default=None, help="monitor URL for confirmed points (default: the swarm's)")
    parser.add_argument(
        "--host-port",
        type=int,
        default=None,
        help="TCP port other peers reach the worker on (default: 49200 + the GPU number; 0 = any free)",
    )
    parser.add_argument(
        "--announce-addr",
        default=None,
        metavar="HOST:PORT",
        help="public address to announce when a NAT or cloud maps another port to this machine",
    )
    parser.add_argument(
        "--no-port-mapping",
        dest="port_mapping",
        action="store_false",
        help="do not ask the home router to forward the worker's port (UPnP or NAT-PMP)",
    )
    parser.add_argument(
        "--retry-every", type=float, default=30.0, help="seconds between join attempts while unreachable"
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
        default=None,
        metavar="PEM",
        help="also trust this CA certificate for the swarm's https:// services (a swarm's own CA; "
        "SSL_CERT_FILE works too, in place of the usual CAs)",
    )
    _add_limit_arguments(parser)
    configure_yield(parser)


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """What the contributor holds the worker to: its microbatch, its upload."""
    parser.add_argument(
        "--batch-size-override",
        type=int,
        default=None,
        metavar="N",
        help="lower the microbatch the GPU's memory plan allows to N",
    )
    parser.add_argument("--max-upload-mbit", type=upload_cap_argument, default=0.0, metavar="N", help=MAX_UPLOAD_HELP)


class _CannotStart(Exception):
    """Why the runtime cannot start (the message), its exit code and, where it helps, what to do."""

    def __init__(self, code: int, reason: str, hint: str | None = None):
        super().__init__(reason)
        self.code, self.hint = code, hint


def run(args: argparse.Namespace) -> int:
    """Token, run description, contributor, then contribute until stopped.

    The exit code as the module docstring says."""
    stop = stop_on_signals()  # first: nothing forked later may inherit the handler
    events = EventWriter(sys.stdout)
    logs_to_events(events)  # the front end shows events; engine log records become events, not stderr
    token = os.environ.get("HF_TOKEN", "")
    if not token:
        return _exit(events, EXIT_USAGE, "no token: set HF_TOKEN (the app does this for you)")
    try:
        device = _device(args)
        _secure_transport(args)
        description = _run_description(args)
        _refuse_plain_http_services(args, description)
    except _CannotStart as failure:
        return _exit(events, failure.code, str(failure), hint=failure.hint, where=STARTING)
    return _contribute_while_allowed(args, device, description, events, stop, token)


def _contribute_while_allowed(
    args: argparse.Namespace,
    device: tuple[str, str],
    description: RunDescription,
    events: EventWriter,
    stop: threading.Event,
    token: str,
) -> int:
    """Join once the GPU may be used (--yield, --active-hours); a worker that yielded past its grace left the swarm,
    and joins again, through the whole join, once the GPU is free."""
    from agora_client.joining.yield_control import wait_until_free
    from agora_client.system.gpu_users import GpuUsers

    policy, users = policy_of(args), GpuUsers(args.gpu)
    control = _pause_control(args, policy, events)
    try:
        while wait_until_free(policy, users, events, stop):
            contributor = _contributor(args, device, description, events, stop, policy)
            on_signals((signal.SIGUSR1,), contributor.retry_now.set)  # the app's "retry now" key
            code = _contribute(contributor, token, events)
            if code is not None:
                return code
            if not contributor.gave_way:
                break
    finally:
        control.close()
        users.close()
    return _exit(events, EXIT_OK, "stopped")


def _pause_control(args: argparse.Namespace, policy: YieldPolicy, events: EventWriter) -> PauseServer:
    """``agora pause`` / ``agora resume`` reach the policy through this; without it the worker still contributes."""
    from agora_client.system.pause_control import PauseControlError, PauseServer

    control = PauseServer(args.config_dir or _default_config_dir(), args.gpu, policy)
    try:
        control.start()
    except (PauseControlError, OSError) as error:
        events.log(f"agora pause cannot reach this runtime: {error}", tag="WARNING", level="warning")
    return control


def _secure_transport(args: argparse.Namespace) -> None:
    """Refuse a plain http:// swarm on the internet before anything is sent to it.

    Then trust ``--ca-cert`` from now on."""
    from agora_client.auth.transport import (
        TOKEN_IN_CLEAR,
        CaCertificateError,
        PlainHttpRefused,
        refuse_plain_http,
        trust_ca_certificate,
    )

    try:
        refuse_plain_http(args.swarm, insecure=args.insecure, what="the swarm's auth service", why=TOKEN_IN_CLEAR)
        if args.ca_cert is not None:
            trust_ca_certificate(args.ca_cert, (args.config_dir or _default_config_dir()) / "trusted-cas.pem")
    except (PlainHttpRefused, CaCertificateError) as error:
        raise _CannotStart(EXIT_USAGE, str(error)) from error
    except OSError as error:
        raise _CannotStart(EXIT_ERROR, f"cannot write the bundle of trusted CA certificates: {error}") from error


def _refuse_plain_http_services(args: argparse.Namespace, description: RunDescription) -> None:
    """The monitor and the snapshot store the run description names, held to the same rule as the swarm's URL."""
    from agora_client.auth.transport import POINTS_IN_CLEAR, WEIGHTS_IN_CLEAR, PlainHttpRefused, refuse_plain_http

    services = (
        (args.monitor or description.monitor_url, "the swarm's monitor", POINTS_IN_CLEAR),
        (description.snapshot_url, "the snapshot store", WEIGHTS_IN_CLEAR),
    )
    try:
        for url, what, why in services:
            if url:
                refuse_plain_http(url, insecure=args.insecure, what=what, why=why)
    except PlainHttpRefused as error:
        raise _CannotStart(EXIT_USAGE, str(error)) from error


def _run_description(args: argparse.Namespace) -> RunDescription:
    """The swarm's run description, once ``--announce-addr`` (if given) is known to be usable."""
    from agora_client.auth.reachability import AnnounceError, parse_announce
    from agora_client.auth.run_description import RunDescriptionError, fetch_description

    if args.announce_addr is not None:
        try:
            parse_announce(args.announce_addr)
        except AnnounceError as error:
            raise _CannotStart(EXIT_USAGE, str(error)) from error
    try:
        return fetch_description(args.swarm)
    except RunDescriptionError as error:
        raise _CannotStart(EXIT_ERROR, str(error)) from error


def _device(args: argparse.Namespace) -> tuple[str, str]:
    """(torch device, note): the chosen GPU, or the CPU only when ``--cpu`` asks for it."""
    from agora_client.system.gpu import CPU_NOTE, NoUsableGpu, torch_device_for

    if args.cpu:
        return "cpu", CPU_NOTE
    try:
        return torch_device_for(args.gpu)
    except NoUsableGpu as error:
        raise _CannotStart(
            EXIT_ERROR,
            f"{error}. A worker needs a usable CUDA GPU",
            hint="choose an NVIDIA GPU that CUDA can use with --gpu N; --cpu runs the worker on the CPU (the demo "
            "and tests only)",
        ) from error


def _contributor(
    args: argparse.Namespace,
    device: tuple[str, str],
    description: RunDescription,
    events: EventWriter,
    stop: threading.Event,
    policy: YieldPolicy,
) -> Contributor:
    """The contributor for this run and device; loads the engine, whose helpers forked from then on die with us."""
    from agora_client.auth.reachability import default_host_port
    from agora_client.joining.contributor import Contributor, ContributorOptions
    from agora_client.system.lifetime import die_with_parent

    die_with_parent()  # a killed worker must not leave hivemind's helpers serving requests

    device, device_note = device
    options = ContributorOptions(
        swarm_url=args.swarm,
        run=description,
        config_dir=args.config_dir or _default_config_dir(),
        host_port=default_host_port(args.gpu) if args.host_port is None else args.host_port,
        gpu=args.gpu,
        device=device,
        device_note=device_note,
        monitor_url=args.monitor or description.monitor_url,
        announce_addr=args.announce_addr,
        port_mapping=args.port_mapping,
        retry_every=args.retry_every,
        batch_size_override=args.batch_size_override,
        insecure=args.insecure,
        yield_policy=policy,
        yield_grace_s=args.yield_grace,
        max_upload_mbit=args.max_upload_mbit,
    )
    return Contributor(options, events, stop)


def _contribute(contributor: Contributor, token: str, events: EventWriter) -> int | None:
    """Run the contributor until it stops, fails or gives way to the GPU's owner, and close it; the exit code when
    it failed, None when it stopped on request or gave way."""
    from agora_client.auth.client import AuthError, AuthRejected
    from agora_client.auth.run_description import RunDescriptionError
    from agora_client.joining.contributor import PreflightFailed
    from agora_client.joining.gpu_fit import StageRefused
    from agora_client.joining.peer_key import PeerKeyError

    try:
        contributor.run(token)
    except AuthRejected as error:  # the auth event said why
        return _exit(events, EXIT_REJECTED, str(error), said=True)
    except AuthError as error:
        return _exit(events, EXIT_ERROR, str(error), said=True)
    except (RunDescriptionError, PreflightFailed, PeerKeyError, StageRefused) as error:
        return _exit(events, EXIT_ERROR, str(error))
    except Exception as error:  # the app shows it; a bare traceback helps nobody
        events.emit(ErrorEvent(message=f"{error.__class__.__name__}: {error}", where="runtime"))
        return _exit(events, EXIT_ERROR, "the worker runtime failed", said=True)
    finally:
        contributor.close()
    return None


def _exit(
    events: EventWriter, code: int, reason: str, *, said: bool = False, hint: str | None = None, where: str = "runtime"
) -> int:
    if code != EXIT_OK and not said:
        events.emit(ErrorEvent(message=reason, hint=hint or "", where=where))
    events.emit(ExitEvent(code=code, reason=reason))
    return code


def _default_config_dir() -> Path:
    from agora_client.client_config import default_config_dir

    return default_config_dir()
