"""`agora leaderboard`: print the monitor's leaderboard as a table, with the address of the swarm's public page and of
each contributor's page (``contributor_url``; with ``--json`` every row carries its ``url``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import quote

import httpx

COLUMNS = (
    ("Rank", "rank"),
    ("User", "username"),
    ("Score (PFLOP)", "score"),
    ("Active h", "active_hours"),
    ("Joined", "joined"),
    ("Status", "online"),
    ("Check", "flagged"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8090", help="the monitor's base URL or its /leaderboard URL")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the monitor")


def monitor_base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/leaderboard")


def leaderboard_url(url: str) -> str:
    return f"{monitor_base_url(url)}/leaderboard"


def contributor_url(url: str, username: str) -> str:
    """The public page of one contributor on the monitor at ``url`` (its base or /leaderboard URL)."""
    return f"{monitor_base_url(url)}/contributors/{quote(username, safe='')}"


def fetch_rows(url: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The leaderboard rows; ValueError with what to do when the monitor cannot give them."""
    target = leaderboard_url(url)
    try:
        response = httpx.get(target, timeout=timeout)
    except httpx.HTTPError as error:
        raise ValueError(
            f"could not reach the monitor at {target} ({error}); is `agora monitor` running there?"
        ) from None
    if response.status_code != 200:
        raise ValueError(f"{target} answered HTTP {response.status_code}; is --url an Agora monitor?")
    try:
        rows = response.json()["rows"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{target} did not answer a leaderboard; is --url an Agora monitor?") from None
    return list(rows)


def _cell(key: str, value: Any) -> str:
    if key == "online":
        return "online" if value else "offline"
    if key == "flagged":
        return "claims more than trainers receipted" if value else ""
    if key == "score":
        return f"{float(value):,.3f}"
    if key == "active_hours":
        return f"{float(value):.2f}"
    if key == "joined":
        return str(value)[:16].replace("T", " ")
    return str(value)


_RIGHT_ALIGNED = {0, 2, 3}  # rank, score, active hours


def _render(line: list[str], widths: list[int]) -> str:
    cells = (
        cell.rjust(w) if i in _RIGHT_ALIGNED else cell.ljust(w)
        for i, (cell, w) in enumerate(zip(line, widths, strict=True))
    )
    return "  ".join(cells).rstrip()


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "No contributors yet: the monitor has verified no metrics record."
    header = [title for title, _ in COLUMNS]
    body = [[_cell(key, row.get(key, "")) for _, key in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *body]
    return "\n".join(_render(line, widths) for line in lines)


def run(args: argparse.Namespace) -> int:
    try:
        rows = fetch_rows(args.url, args.timeout)
    except ValueError as error:
        print(f"[LEADERBOARD] {error}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps(
                [{**row, "url": contributor_url(args.url, str(row.get("username", "")))} for row in rows], indent=2
            )
        )
        return 0
    print(format_table(rows))
    if rows:
        base, first = monitor_base_url(args.url), str(rows[0].get("username", ""))
        print(
            f"\nThe swarm's page: {base}/\nEach contributor's page: {base}/contributors/<user>, "
            f"e.g. {contributor_url(args.url, first)}"
        )
    return 0
