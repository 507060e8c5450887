"""The run description: everything a joiner needs to know about a swarm, served by its auth service.

``GET /v1/run`` answers ``{"v": 1, "config": {...}, "seeds": [...], "snapshot_url": ..., "monitor_url": ...,
"hash": "sha256:<hex>"}``. ``config`` is the full run config (model shapes, stage split, optimizer and
batch targets, SPARTA, sync phases); the hash covers every other field, so a client can tell that the
swarm it joined is still the same run (``watch`` re-reads it while the worker runs).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import httpx

from agora_client.config import ConfigError, RunConfig, parse_config

DESCRIPTION_VERSION = 1
RUN_PATH = "/v1/run"


class RunDescriptionError(Exception):
    """The description could not be read or is not one this client can use; the message says what to do."""


class RunChanged(RunDescriptionError):
    """The swarm now serves a description with another hash than the one this client joined."""


@dataclass(frozen=True)
class RunDescription:
    config: RunConfig
    seeds: tuple[str, ...]
    snapshot_url: str | None
    monitor_url: str | None
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {**_content(self.config, self.seeds, self.snapshot_url, self.monitor_url), "hash": self.hash}


def describe_run(config: RunConfig, seeds: tuple[str, ...], snapshot_url: str | None, monitor_url: str | None) -> RunDescription:
    """The description the auth service serves, with its content hash."""
    content = _content(config, seeds, snapshot_url, monitor_url)
    return RunDescription(config, tuple(seeds), snapshot_url, monitor_url, content_hash(content))


def content_hash(content: dict[str, Any]) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


def parse_description(data: Any, source: str) -> RunDescription:
    """Check version, fields and hash of a served description; RunDescriptionError saying what is wrong."""
    if not isinstance(data, dict) or data.get("v") != DESCRIPTION_VERSION:
        raise RunDescriptionError(
            f"{source} is not a version {DESCRIPTION_VERSION} run description; is the URL the swarm's auth service, "
            "and is this client up to date?"
        )
    seeds = data.get("seeds")
    if not isinstance(seeds, list) or not seeds or not all(isinstance(seed, str) and seed for seed in seeds):
        raise RunDescriptionError(f"{source} lists no seed to join through; tell the swarm's operator")
    for name in ("snapshot_url", "monitor_url"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise RunDescriptionError(f"{source}: {name} is not a URL; tell the swarm's operator")
    try:
        config = parse_config(data.get("config"), f"served by {source}")
    except ConfigError as error:
        raise RunDescriptionError(f"{error}\nthis client cannot run that config; update the client or tell the operator") from None
    content = _content(config, tuple(seeds), data.get("snapshot_url"), data.get("monitor_url"))
    if data.get("hash") != content_hash(content):
        raise RunDescriptionError(f"{source}: the run description does not match its hash (altered in transit?); try again")
    return RunDescription(config, tuple(seeds), data.get("snapshot_url"), data.get("monitor_url"), data["hash"])


def fetch_description(swarm_url: str, *, client: httpx.Client | None = None, timeout_s: float = 15.0) -> RunDescription:
    url = f"{swarm_url.rstrip('/')}{RUN_PATH}"
    http = client or httpx.Client(timeout=timeout_s)
    try:
        response = http.get(url)
    except httpx.HTTPError as error:
        raise RunDescriptionError(
            f"could not read the run description at {url} ({type(error).__name__}); check the swarm URL and your network"
        ) from None
    finally:
        if client is None:
            http.close()
    if response.status_code != 200:
        raise RunDescriptionError(f"{url} answered HTTP {response.status_code}; is this the swarm's auth service URL?")
    try:
        data = response.json()
    except ValueError:
        raise RunDescriptionError(f"{url} did not answer JSON; is this the swarm's auth service URL?") from None
    return parse_description(data, url)


def check_unchanged(swarm_url: str, joined: RunDescription, *, client: httpx.Client | None = None) -> None:
    """Raise RunChanged if the swarm now describes another run; RunDescriptionError if it cannot be read."""
    current = fetch_description(swarm_url, client=client)
    if current.hash != joined.hash:
        raise RunChanged(
            f"the swarm's run description changed while this worker ran ({joined.hash[:19]} -> {current.hash[:19]}); "
            "the worker stopped so that it does not train a model the swarm no longer runs: start the client again"
        )


def _content(config: RunConfig, seeds: tuple[str, ...], snapshot_url: str | None, monitor_url: str | None) -> dict[str, Any]:
    return {
        "v": DESCRIPTION_VERSION,
        "config": config.model_dump(mode="json"),
        "seeds": list(seeds),
        "snapshot_url": snapshot_url,
        "monitor_url": monitor_url,
    }
