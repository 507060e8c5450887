"""The run description: everything a joiner needs to know about a swarm, served by its auth service.

``GET /v1/run`` answers ``{"v": 1, "config": {...}, "seeds": [...], "snapshot_url": ..., "monitor_url": ...,
"tokenizer": {"sha256": ..., "vocab_size": ..., "eos_token": ...}, "relays": ["host:port", ...], "hash":
"sha256:<hex>"}`` (``relays``: the operator's relays, for workers no port mapping can open; may be empty). ``config`` is
the full run config (model shapes, stage split, optimizer and batch targets, SPARTA, sync phases); the hash covers every
other field, so a client can tell that the swarm it joined is still the same run (``watch`` re-reads it while the worker
runs). ``GET /v1/tokenizer`` serves the tokenizer's JSON file; ``fetch_tokenizer`` checks it against the description's
sha256 and the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import httpx

from agora_client.config import ConfigError, RunConfig, parse_config
from agora_client.data.tokenizer import MAX_TOKENIZER_BYTES, RunTokenizer, TokenizerError, from_served
from agora_client.network.outage import Outage, send

from .transport import connection_failure

DESCRIPTION_VERSION = 1
RUN_PATH = "/v1/run"
TOKENIZER_PATH = "/v1/tokenizer"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class RunDescriptionError(Exception):
    """The description could not be read or is not one this client can use; the message says what to do."""


class RunChanged(RunDescriptionError):
    """The swarm now serves a description with another hash than the one this client joined."""


@dataclass(frozen=True)
class TokenizerSummary:
    """What the description says of the run's tokenizer: the served file must hash to ``sha256``."""

    sha256: str
    vocab_size: int
    eos_token: str | None

    @classmethod
    def of(cls, tokenizer: RunTokenizer) -> "TokenizerSummary":
        return cls(tokenizer.sha256, tokenizer.vocab_size, tokenizer.eos_token)

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "vocab_size": self.vocab_size, "eos_token": self.eos_token}


@dataclass(frozen=True)
class RunDescription:
    config: RunConfig
    seeds: tuple[str, ...]
    snapshot_url: str | None
    monitor_url: str | None
    tokenizer: TokenizerSummary
    hash: str
    relays: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        content = _content(self.config, self.seeds, self.snapshot_url, self.monitor_url, self.tokenizer, self.relays)
        return {**content, "hash": self.hash}


def describe_run(
    config: RunConfig,
    seeds: tuple[str, ...],
    snapshot_url: str | None,
    monitor_url: str | None,
    tokenizer: TokenizerSummary,
    relays: tuple[str, ...] = (),
) -> RunDescription:
    """The description the auth service serves, with its content hash."""
    content = _content(config, seeds, snapshot_url, monitor_url, tokenizer, relays)
    return RunDescription(
        config, tuple(seeds), snapshot_url, monitor_url, tokenizer, content_hash(content), tuple(relays)
    )


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
        raise RunDescriptionError(
            f"{error}\nthis client cannot run that config; update the client or tell the operator"
        ) from None
    tokenizer = _parse_tokenizer(data.get("tokenizer"), config, source)
    relays = data.get("relays", [])
    if not isinstance(relays, list) or not all(isinstance(relay, str) and relay for relay in relays):
        raise RunDescriptionError(f"{source}: relays is not a list of HOST:PORT; tell the swarm's operator")
    content = _content(
        config, tuple(seeds), data.get("snapshot_url"), data.get("monitor_url"), tokenizer, tuple(relays)
    )
    if data.get("hash") != content_hash(content):
        raise RunDescriptionError(
            f"{source}: the run description does not match its hash (altered in transit?); try again"
        )
    return RunDescription(
        config, tuple(seeds), data.get("snapshot_url"), data.get("monitor_url"), tokenizer, data["hash"], tuple(relays)
    )


def _parse_tokenizer(data: Any, config: RunConfig, source: str) -> TokenizerSummary:
    """The description's tokenizer section, whose vocabulary must be the model's."""
    fields = data if isinstance(data, dict) else {}
    sha256, vocab_size, eos_token = fields.get("sha256"), fields.get("vocab_size"), fields.get("eos_token")
    if (
        not isinstance(sha256, str)
        or not _SHA256.match(sha256)
        or not isinstance(vocab_size, int)
        or isinstance(vocab_size, bool)
        or vocab_size <= 0
        or not (eos_token is None or isinstance(eos_token, str))
    ):
        raise RunDescriptionError(
            f"{source}: the run description names no usable tokenizer (tokenizer.sha256, vocab_size, eos_token); "
            "its auth service may be older than this client: tell the swarm's operator"
        )
    if vocab_size != config.model.vocab_size:
        raise RunDescriptionError(
            f"{source}: the run's tokenizer has {vocab_size:,} tokens but its model.vocab_size is "
            f"{config.model.vocab_size:,}; the swarm is misconfigured: tell the swarm's operator"
        )
    return TokenizerSummary(sha256, vocab_size, eos_token)


def fetch_description(swarm_url: str, *, client: httpx.Client | None = None, timeout_s: float = 15.0) -> RunDescription:
    url = f"{swarm_url.rstrip('/')}{RUN_PATH}"
    http = client or httpx.Client(timeout=timeout_s)
    try:
        response = http.get(url)
    except httpx.HTTPError as error:
        raise RunDescriptionError(
            f"could not read the run description at {url} ({connection_failure(error)}); check the swarm URL "
            "and your network"
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


def fetch_tokenizer(
    swarm_url: str, run: RunDescription, *, timeout_s: float = 30.0, outage: Outage | None = None
) -> RunTokenizer:
    """The tokenizer the swarm serves, refused unless it hashes to the description's sha256 and fits the model.

    With ``outage``, a service down is waited for (network/outage.py)."""
    url = f"{swarm_url.rstrip('/')}{TOKENIZER_PATH}"
    content = _download_tokenizer(url, timeout_s, outage)
    try:
        return from_served(run.config, content, run.tokenizer.sha256, where=url)
    except TokenizerError as error:
        raise RunDescriptionError(
            f"the swarm's tokenizer cannot be used, so this worker does not join: {error}"
        ) from None


def _download_tokenizer(url: str, timeout_s: float, outage: Outage | None) -> bytes:
    """The served file's bytes, read up to MAX_TOKENIZER_BYTES."""
    content = bytearray()
    try:
        with (
            httpx.Client(timeout=timeout_s) as http,
            closing(send(outage, lambda: http.send(http.build_request("GET", url), stream=True))) as response,
        ):
            if response.status_code != 200:
                raise RunDescriptionError(
                    f"{url} answered HTTP {response.status_code}: the swarm's auth service does not serve the run's "
                    "tokenizer; it may be older than this client: tell the swarm's operator"
                )
            for chunk in response.iter_bytes():
                content += chunk
                if len(content) > MAX_TOKENIZER_BYTES:
                    raise RunDescriptionError(
                        f"{url} sent more than {MAX_TOKENIZER_BYTES >> 20} MiB, more than any tokenizer file: "
                        "not joining; tell the swarm's operator"
                    )
    except httpx.HTTPError as error:
        raise RunDescriptionError(
            f"could not download the run's tokenizer from {url} ({type(error).__name__}); check your network "
            "and try again"
        ) from None
    return bytes(content)


def _content(
    config: RunConfig,
    seeds: tuple[str, ...],
    snapshot_url: str | None,
    monitor_url: str | None,
    tokenizer: TokenizerSummary,
    relays: tuple[str, ...],
) -> dict[str, Any]:
    return {
        "v": DESCRIPTION_VERSION,
        "config": config.model_dump(mode="json"),
        "seeds": list(seeds),
        "snapshot_url": snapshot_url,
        "monitor_url": monitor_url,
        "tokenizer": tokenizer.to_json(),
        "relays": list(relays),
    }
