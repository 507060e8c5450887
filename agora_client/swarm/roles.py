"""Each role's command line (``agora <role> ...``) and the line it prints once ready.

One rule for both who start roles: the local swarm (``launcher.py``: every role on one host, ports chosen
at random) and the operator's deploy file (``agora_client.deploy``: roles on fixed public ports). Options
left at None are not passed, so the role's own default holds. Secrets are passed as file paths only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from agora_client.discovery.seed import READY_PREFIX as SEED_READY

WORKER_READY = "[WORKER]"
AUTH_READY = "[AUTH] listening on"
RELAY_READY = "[RELAY] listening on"
MONITOR_READY = "[MONITOR] leaderboard on"
SNAPSHOTS_READY = "[SNAPSHOTS] serving"
TRAINER_READY = "[DATA]"  # its data and tokenizer are loaded; it then waits for workers and trains

__all__ = [
    "AUTH_READY",
    "MONITOR_READY",
    "RELAY_READY",
    "SEED_READY",
    "SNAPSHOTS_READY",
    "TRAINER_READY",
    "WORKER_READY",
    "ExposureArgs",
    "auth_args",
    "issued_tickets",
    "monitor_args",
    "relay_args",
    "seed_args",
    "self_signed_tickets",
    "snapshot_server_args",
    "trainer_args",
    "worker_args",
]


@dataclass(frozen=True)
class ExposureArgs:
    """How an HTTP role meets the network: its own TLS certificate and key (PEM files), trusted reverse proxies."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    trusted_proxies: tuple[str, ...] = ()

    def args(self) -> list[str]:
        args = ["--tls-cert", str(self.tls_cert), "--tls-key", str(self.tls_key)] if self.tls_cert else []
        for proxy in self.trusted_proxies:
            args += ["--trusted-proxy", proxy]
        return args


def _optional(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


def seed_args(host: str, seeds: Sequence[str], *, port: int | None = None, identity: Path | None = None) -> list[str]:
    """A DHT bootstrap peer; ``identity`` (a key file) and ``port`` make its multiaddr the same on every start."""
    return ["seed", "--host", host, "--seeds", *seeds, *_optional("--port", port), *_optional("--identity", identity)]


def snapshot_server_args(directory: Path, host: str, port: int, exposure: ExposureArgs = ExposureArgs()) -> list[str]:
    return ["snapshot-server", "--dir", str(directory), "--host", host, "--port", str(port), *exposure.args()]


def relay_args(host: str, port: int, public_host: str, ports: str, auth_public_key: str) -> list[str]:
    return [
        "relay",
        *("--host", host, "--port", str(port), "--public-host", public_host, "--ports", ports),
        *("--auth-public-key", auth_public_key),
    ]


def auth_args(
    *,
    preset: str,
    state_dir: Path,
    host: str,
    seeds: Sequence[str],
    snapshot_url: str,
    port: int | None = None,
    token_file: Path | None = None,
    pacing: float | None = None,
    max_workers_per_stage: int | None = None,
    stage_targets: Mapping[str, int] | None = None,
    monitor_url: str | None = None,
    relays: Sequence[str] = (),
    exposure: ExposureArgs = ExposureArgs(),
) -> list[str]:
    """The auth service; identities from ``token_file`` (token-file identities) or else from Hugging Face."""
    args = ["auth", "--state-dir", str(state_dir), "--config", preset, "--host", host, *_optional("--port", port)]
    args += (
        ["--identity", "token-file", "--token-file", str(token_file)] if token_file else ["--identity", "huggingface"]
    )
    args += ["--snapshot-url", snapshot_url, *_optional("--pacing", pacing)]
    args += [*_optional("--max-workers-per-stage", max_workers_per_stage), *_optional("--monitor-url", monitor_url)]
    for seed in seeds:
        args += ["--seed", seed]
    for relay in relays:
        args += ["--relay", relay]
    for stage, target in (stage_targets or {}).items():
        args += ["--stage-target", f"{stage}={target}"]
    return [*args, *exposure.args()]


def monitor_args(
    *,
    preset: str,
    seeds: Sequence[str],
    auth_url: str,
    db: Path,
    host: str,
    port: int,
    interval: float,
    exposure: ExposureArgs = ExposureArgs(),
) -> list[str]:
    args = ["monitor", "--initial-peers", *seeds, "--auth-url", auth_url, "--config", preset]
    args += ["--db", str(db), "--port", str(port), "--interval", str(interval), "--host", host]
    return [*args, *exposure.args()]


def worker_args(
    *,
    stage: str,
    index: int,
    preset: str,
    host: str,
    seeds: Sequence[str],
    ticket_key: Path | None,
    events: Path,
    recover_from: Path | None = None,
    publish_to: str | None = None,
    publish_every: int | None = None,
    checkpoints: str | None = None,
    snapshot: Path | None = None,
    device: str | None = None,
) -> list[str]:
    """An operator's worker: it signs its own ticket with the auth service's key (``ticket_key``; None: an open worker,
    which serves callers without tickets)."""
    args = ["worker", "--stage", stage, "--index", str(index), "--preset", preset, "--host", host, "--seeds", *seeds]
    args += [
        *(_optional("--ticket-key", ticket_key) if ticket_key is not None else ["--open"]),
        "--events",
        str(events),
        *_optional("--recover-from", recover_from),
    ]
    if publish_to is not None:
        args += ["--publish-snapshots", publish_to, *_optional("--publish-every", publish_every)]
    return [
        *args,
        *_optional("--checkpoints", checkpoints),
        *_optional("--snapshot", snapshot),
        *_optional("--device", device),
    ]


def self_signed_tickets(signing_key: Path) -> list[str]:
    """A trainer on the auth service's own host (the local swarm) signs its tickets with the service's key."""
    return ["--ticket-key", str(signing_key)]


def issued_tickets(credential_file: Path, auth_url: str, insecure: bool = False) -> list[str]:
    """A trainer without the signing key: the auth service exchanges its credential (a file) for tickets."""
    return ["--credential-file", str(credential_file), "--auth-url", auth_url, *(["--insecure"] if insecure else [])]


def trainer_args(
    *,
    preset: str,
    host: str,
    seeds: Sequence[str],
    tickets: Sequence[str],
    shard: str,
    report_every: float,
    checkpoints: str | None = None,
    resume_position: Path | None = None,
) -> list[str]:
    args = ["trainer", "--preset", preset, "--host", host, "--seeds", *seeds, *tickets]
    args += ["--shard", shard, "--report-every", str(report_every), *_optional("--checkpoints", checkpoints)]
    return [*args, *_optional("--resume-position", resume_position)]
