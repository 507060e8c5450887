"""`agora runtime`: the contributor's worker runtime, supervised by the app or the headless printer.

It authorizes with the swarm's auth service (token from ``HF_TOKEN``), downloads the assigned
stage's snapshot (already while queued), waits in the join queue, then runs a worker that passes
through sync phases 1 and 2 to active. Everything it has to say goes to stdout as events, one JSON
object per line (agora_client/events.py). SIGINT or SIGTERM stop it gracefully.

Exit codes: 0 stopped on request, 1 runtime error, 2 bad usage or config, 3 rejected by the swarm.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from agora_client.config import ConfigError, load_config
from agora_client.events import ErrorEvent, EventWriter, ExitEvent

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REJECTED = 0, 1, 2, 3


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm", required=True, help="URL of the swarm's auth service")
    parser.add_argument("--gpu", type=int, default=None, help="CUDA device index (default: CPU when there is no GPU)")
    parser.add_argument("--config-dir", type=Path, default=None, help="where identity keys and downloads live")
    parser.add_argument("--preset", default="tiny", help="the swarm's run config preset")
    parser.add_argument("--monitor", default=None, help="monitor URL for confirmed points")
    parser.add_argument("--lie", action="store_true", help=argparse.SUPPRESS)  # tests: a dishonest worker


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # the front end shows events, not engine chatter
    events = EventWriter(sys.stdout)
    token = os.environ.get("HF_TOKEN", "")
    if not token:
        return _exit(events, EXIT_USAGE, "no token: set HF_TOKEN (the app does this for you)")
    try:
        config = load_config(args.preset)
    except ConfigError as error:
        return _exit(events, EXIT_USAGE, str(error))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    from agora_client.auth.client import AuthRejected, AuthError
    from agora_client.worker.contributor import Contributor, ContributorOptions
    from agora_client.system.lifetime import die_with_parent

    die_with_parent()  # a killed worker must not leave hivemind's helpers serving requests

    config_dir = args.config_dir or _default_config_dir()
    options = ContributorOptions(
        swarm_url=args.swarm, config=config, config_dir=config_dir, gpu=args.gpu, monitor_url=args.monitor, lie=args.lie
    )
    contributor = Contributor(options, events, stop)
    try:
        contributor.run(token)
    except AuthRejected as error:
        return _exit(events, EXIT_REJECTED, str(error))
    except AuthError as error:
        return _exit(events, EXIT_ERROR, str(error))
    except Exception as error:  # the app shows it; a bare traceback helps nobody
        events.emit(ErrorEvent(message=f"{error.__class__.__name__}: {error}", where="runtime"))
        return _exit(events, EXIT_ERROR, "the worker runtime failed; see the error above")
    finally:
        contributor.close()
    return _exit(events, EXIT_OK, "stopped")


def _exit(events: EventWriter, code: int, reason: str) -> int:
    if code != EXIT_OK:
        events.emit(ErrorEvent(message=reason, where="runtime"))
    events.emit(ExitEvent(code=code, reason=reason))
    return code


def _default_config_dir() -> Path:
    from agora_client.client_config import default_config_dir

    return default_config_dir()
