"""`agora trainer-credential add|revoke|list`: the operator's trainer credentials, on the auth service's host."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from .trainer_credentials import TrainerCredentials


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=("add", "revoke", "list"),
        help="add: make a credential and print its token once; revoke: stop its renewals; list",
    )
    parser.add_argument("name", nargs="?", help="the credential's name (add, revoke), e.g. the trainer's host")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path.home() / ".agora" / "auth",
        help="the auth service's state directory (its --state-dir)",
    )


def run(args: argparse.Namespace) -> int:
    credentials = TrainerCredentials(args.state_dir)
    if args.action == "list":
        for credential in credentials.list():
            state = "revoked " + _when(credential.revoked_at) if credential.revoked_at else "live"
            print(f"{credential.name}\tcreated {_when(credential.created_at)}\t{state}")
        return 0
    if not args.name:
        print(f"agora trainer-credential {args.action}: give the credential's name", file=sys.stderr)
        return 2
    try:
        if args.action == "add":
            token = credentials.add(args.name)
            print(
                f"[CREDENTIAL] {args.name}: put this token in the trainer's --credential-file (mode 0600); "
                "it is not shown again",
                file=sys.stderr,
            )
            print(token.reveal())
            return 0
        revoked = credentials.revoke(args.name)
    except (ValueError, KeyError) as error:
        print(f"agora trainer-credential: {error.args[0]}", file=sys.stderr)
        return 2
    print(f"[CREDENTIAL] {args.name}: {'revoked; its tickets are not renewed' if revoked else 'was revoked already'}")
    return 0


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")
