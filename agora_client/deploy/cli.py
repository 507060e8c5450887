"""This host's roles of a swarm, from the operator's deploy file.

`agora deploy up|down|units|firewall FILE [--host NAME]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agora_client.config import ConfigError

from .spec import DeployError, DeploySpec, HttpRole, Roles, chosen_host, load_spec
from .stop import down

CHECKOUT = Path(__file__).resolve().parents[2]  # where agora_cli.py is


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="start this host's roles, each once the ones before it are ready")
    up.add_argument("--detach", action="store_true", help="return once every role is ready, leaving them running")
    down_parser = actions.add_parser("down", help="stop what `up` started on this host")
    down_parser.add_argument(
        "--grace",
        type=float,
        default=15.0,
        help="seconds a role left by a killed supervisor has to stop before it is killed",
    )
    units = actions.add_parser("units", help="write a systemd unit per role of this host, and agora.target")
    units.add_argument("--out", type=Path, required=True, help="directory for the units (e.g. /etc/systemd/system)")
    units.add_argument("--user", default=None, help="the user the roles run as (User=); default: systemd's")
    units.add_argument("--python", default=sys.executable, help="the Python that runs agora_cli.py (default: this one)")
    firewall_parser = actions.add_parser(
        "firewall",
        help="print (or --apply, --remove) nftables rules that limit new connections "
        "per client address to this host's HTTP roles in the kernel",
    )
    change = firewall_parser.add_mutually_exclusive_group()
    change.add_argument("--apply", action="store_true", help="load the rules (root, nftables; replaces earlier ones)")
    change.add_argument("--remove", action="store_true", help="delete the rules (nothing happens when there are none)")
    firewall_parser.add_argument(
        "--tracked-sources",
        type=_positive_count,
        default=None,
        metavar="N",
        help="client addresses limited each under its own key at once (default 65535); beyond them, per /16 or /48",
    )
    for action in (up, down_parser, units, firewall_parser):
        action.add_argument("file", type=Path, help="the deploy file (YAML)")
        action.add_argument("--host", default=None, help="which host of the file this is (default: its this_host)")


def _positive_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give at least 1")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.file)
        host = chosen_host(spec, args.host)
        if args.action == "down":
            return down(spec, host, args.grace)
        if args.action == "firewall":
            return firewall(spec, host, args)
        from .plan import plan_roles  # hivemind (seed keys' peer ids) and torch: not for `down`
        from .secrets import prepare_secrets

        steps = plan_roles(spec, host, prepare_secrets(spec, host))
        (spec.run.dir / "events").mkdir(parents=True, exist_ok=True)  # workers append their events there
    except (DeployError, ConfigError) as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 2
    from .supervisor import start_detached, supervise
    from .units import write_units

    if args.action == "units":
        paths = write_units(
            steps, args.out, python=args.python, checkout=CHECKOUT, secrets=spec.secrets, user=args.user
        )
        print(f"[DEPLOY] wrote {len(paths)} files to {args.out}: {', '.join(path.name for path in paths)}")
        print("[DEPLOY] then: systemctl daemon-reload && systemctl enable --now agora.target")
        return 0
    if args.detach:
        return start_detached(spec, host, args.file)
    return supervise(spec, host, steps)


def firewall(spec: DeploySpec, host_name: str, args: argparse.Namespace) -> int:
    """`agora deploy firewall`: the per-address connection rate limit of this host's HTTP ports, printed, applied or
    removed."""
    from .firewall import (
        DEFAULT_BURST,
        DEFAULT_PER_MINUTE,
        TRACKED_SOURCES,
        FirewallError,
        apply_ruleset,
        remove_ruleset,
        render_ruleset,
    )

    host = spec.hosts[host_name]
    ports = http_ports(host.roles)
    try:
        if args.remove:
            remove_ruleset()
            print("[DEPLOY] removed the nftables table agora_guard")
            return 0
        if not ports:
            print(f"[DEPLOY] host {host_name} runs no HTTP role (auth, monitor, snapshot_server): no firewall rules")
            return 0
        script = render_ruleset(ports, exempt=host.trusted_proxies, tracked=args.tracked_sources or TRACKED_SOURCES)
        if not args.apply:
            print(script, end="")
            return 0
        apply_ruleset(script)
    except FirewallError as error:
        print(f"[ERROR] {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # a trusted proxy that is no address
        print(f"[ERROR] hosts.{host_name}.trusted_proxies: {error}", file=sys.stderr)
        return 2
    print(
        f"[DEPLOY] the kernel now drops new connections to ports {', '.join(map(str, sorted(ports)))} "
        f"from a client address beyond {DEFAULT_BURST} at once and {DEFAULT_PER_MINUTE} a minute (remove with --remove)"
    )
    return 0


def http_ports(roles: Roles) -> list[int]:
    """The ports of the roles that serve HTTP (auth, monitor, snapshot server): every role that is an HttpRole."""
    return [
        role.port for role in (getattr(roles, name) for name in type(roles).model_fields) if isinstance(role, HttpRole)
    ]
