#!/usr/bin/env python3
"""Agora contributor client and swarm roles. Run with no arguments to join the swarm.

This entry point alone chooses the front end: the Textual app, or the headless printer with
--headless. agora_client never imports tui/.
"""

import sys

from agora_client.cli import main as cli_main
from agora_client.frontend.client import ClientSession


def front_end(session: ClientSession) -> int:
    if session.headless:
        from agora_client.frontend.headless import run_session

        return run_session(session)
    from tui.launch import run_app  # Textual loads only for the app

    return run_app(session)


def main(argv: list[str] | None = None) -> int:
    return cli_main(argv, front_end)


if __name__ == "__main__":
    sys.exit(main())
