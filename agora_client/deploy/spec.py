"""The deploy file: the run config, the stores, the secret store, and per host its address and the roles it runs.

Every host of the swarm is in the one file, so each can work out the others' public URLs (auth service,
monitor, snapshot server) from their addresses and ports; ``agora deploy up FILE --host NAME`` (or the file's
``this_host``) starts the roles of one of them. ``load_spec`` says what is wrong, naming the field.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from agora_client.config import describe_validation_error


class DeployError(ValueError):
    """The deploy file (or what it names) cannot be used; the message says what to change."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _from_file_dir(value: Path, info: ValidationInfo) -> Path:
    """A relative path in the deploy file is relative to the file's own directory."""
    base = (info.context or {}).get("base")
    return value if base is None or value.is_absolute() else (base / value).resolve()


def _store_from_file_dir(value: str, info: ValidationInfo) -> str:
    return value if value.startswith("s3://") else str(_from_file_dir(Path(value), info))


def _config_from_file_dir(value: str, info: ValidationInfo) -> str:
    return str(_from_file_dir(Path(value), info)) if value.endswith((".yaml", ".yml")) else value


FilePath = Annotated[Path, AfterValidator(_from_file_dir)]
StoreLocation = Annotated[str, AfterValidator(_store_from_file_dir)]


class RunSection(_Strict):
    config: Annotated[str, AfterValidator(_config_from_file_dir)] = Field(
        description="run config: a preset name (tiny, 8b) or the path of a run-config YAML"
    )
    dir: FilePath = Field(description="logs, the monitor's database, the state of `agora deploy up`")


class Stores(_Strict):
    snapshots: StoreLocation = Field(
        description="where workers publish stage snapshots: a directory or s3://bucket/prefix"
    )
    checkpoints: StoreLocation | None = Field(
        None, description="timestamped checkpoint sets: a directory or s3://bucket/prefix"
    )

    @property
    def snapshots_in_s3(self) -> bool:
        return self.snapshots.startswith("s3://")


class HttpRole(_Strict):
    port: int = Field(ge=1, le=65535)
    public_url: str | None = Field(None, description="the URL the world uses, when a reverse proxy stands in front")


class SeedsRole(_Strict):
    count: int = Field(2, ge=1, le=8)
    port: int = Field(31330, ge=1, le=65535, description="the first seed's port; the next seeds take the next ports")


class AuthRole(HttpRole):
    port: int = Field(8440, ge=1, le=65535)
    identity: Literal["huggingface", "token-file"] = "huggingface"
    token_file: FilePath | None = Field(None, description="hashed tokens for identity token-file")
    pacing: float | None = Field(None, gt=0)
    max_workers_per_stage: int | None = Field(None, ge=1)
    stage_targets: dict[str, PositiveInt] | None = Field(
        None, description="workers a stage should have, instead of its compute's share (--stage-target STAGE=N)"
    )

    @model_validator(mode="after")
    def _token_file_for_token_identities(self) -> "AuthRole":
        if (self.identity == "token-file") != (self.token_file is not None):
            raise ValueError("identity token-file needs token_file (and token_file needs identity token-file)")
        return self


class MonitorRole(HttpRole):
    port: int = Field(8090, ge=1, le=65535)
    interval: float = Field(10.0, gt=0)


class SnapshotServerRole(HttpRole):
    port: int = Field(8080, ge=1, le=65535)


class RelayRole(_Strict):
    port: int = Field(47100, ge=1, le=65535, description="the control port workers reserve on")
    ports: str = Field("47000-47099", pattern=r"^\d+-\d+$", description="public ports handed to workers, LO-HI")


class WorkersRole(_Strict):
    per_stage: int = Field(1, ge=1)
    publish_every: int = Field(
        5, ge=1, description="epochs between the snapshots the first worker of a stage publishes"
    )
    device: str | None = Field(None, description="torch device (default: cuda if available, else cpu)")


class TrainersRole(_Strict):
    count: int = Field(1, ge=1)
    report_every: float = Field(60.0, gt=0)
    insecure: bool = Field(False, description="allow a plain http:// auth URL beyond private networks")


class Roles(_Strict):
    seeds: SeedsRole | None = None
    auth: AuthRole | None = None
    monitor: MonitorRole | None = None
    snapshot_server: SnapshotServerRole | None = None
    relay: RelayRole | None = None
    workers: WorkersRole | None = None
    trainers: TrainersRole | None = None


class TlsFiles(_Strict):
    cert: FilePath = Field(description="PEM certificate, the server's own first, then its chain")
    key: FilePath = Field(description="its unencrypted PEM private key")


class MetricsPorts(_Strict):
    port: int = Field(
        ge=1,
        le=65535,
        description="the first Prometheus port: seeds, relay, workers and trainers "
        "(the roles without an HTTP port of their own) take one each, in start order",
    )
    listen: str = Field("127.0.0.1", description="the address those ports listen on: one your Prometheus reaches")


class HostSpec(_Strict):
    address: str = Field(description="the IPv4 address this host's roles listen on and peers reach it at")
    roles: Roles = Roles()
    tls: TlsFiles | None = None
    trusted_proxies: tuple[str, ...] = ()
    metrics: MetricsPorts | None = Field(None, description="Prometheus ports for the roles without an HTTP port")

    @model_validator(mode="after")
    def _ipv4_address(self) -> "HostSpec":
        try:
            ipaddress.IPv4Address(self.address)
        except ValueError:
            raise ValueError(
                f"address {self.address!r} is not an IPv4 address: give the address of this host's "
                "interface that peers reach (roles listen on it and announce /ip4/ multiaddrs)"
            ) from None
        return self

    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def url(self, role: HttpRole) -> str:
        return role.public_url or f"{self.scheme()}://{self.address}:{role.port}"


ONE_PER_SWARM = ("auth", "monitor", "snapshot_server", "relay")
HOST_NAME = re.compile(r"^[A-Za-z0-9._-]{1,40}$")


class DeploySpec(_Strict):
    run: RunSection
    secrets: FilePath = Field(description="the secret store: signing key, seed keys, trainer credentials (mode 0700)")
    stores: Stores
    seeds: tuple[str, ...] = Field((), description="seed multiaddrs, for hosts that do not hold the seeds' keys")
    hosts: dict[str, HostSpec] = Field(min_length=1)
    this_host: str | None = None

    @model_validator(mode="after")
    def _roles_fit_together(self) -> "DeploySpec":
        for role in ONE_PER_SWARM:
            holders = [name for name, host in self.hosts.items() if getattr(host.roles, role) is not None]
            if len(holders) > 1:
                raise ValueError(f"hosts {', '.join(holders)} all run {role}: a swarm has one")
        for name in self.hosts:
            if not HOST_NAME.match(name):
                raise ValueError(
                    f"host name {name!r}: use 1-40 letters, digits, '.', '_' or '-' (it names credentials)"
                )
        if self.this_host is not None and self.this_host not in self.hosts:
            raise ValueError(f"this_host {self.this_host!r} is not one of hosts: {', '.join(self.hosts)}")
        if self.holder("auth") is None:
            raise ValueError("no host runs auth: add an auth role to the operator's host")
        _check_workers_on_auth_host(self)
        _check_snapshot_source(self)
        if not self.seeds and self.holder("seeds") is None:
            raise ValueError("no host runs seeds and no seeds are listed: add a seeds role to a host")
        return self

    def holder(self, role: str) -> str | None:
        """The name of the (first) host that runs ``role``."""
        return next((name for name, host in self.hosts.items() if getattr(host.roles, role) is not None), None)

    def role_url(self, role: str) -> str | None:
        """The public URL of the HTTP role ``role`` (auth, monitor, snapshot_server); None when no host runs it."""
        name = self.holder(role)
        return None if name is None else self.hosts[name].url(getattr(self.hosts[name].roles, role))

    def snapshot_url(self) -> str:
        """What joiners download snapshots from: the S3 store itself, or the snapshot server."""
        return self.stores.snapshots if self.stores.snapshots_in_s3 else str(self.role_url("snapshot_server"))

    def trainer_names(self) -> list[str]:
        """Every trainer of the swarm, host by host in file order: its shard is its place in this list."""
        return [
            trainer_name(host, index)
            for host, spec in self.hosts.items()
            if spec.roles.trainers
            for index in range(spec.roles.trainers.count)
        ]


def trainer_name(host: str, index: int) -> str:
    """A trainer's name: its credential's and its log's."""
    return f"{host}-trainer{index}"


def _check_workers_on_auth_host(spec: DeploySpec) -> None:
    for name, host in spec.hosts.items():
        if host.roles.workers is not None and name != spec.holder("auth"):
            raise ValueError(
                f"host {name} runs workers, but operator workers sign their tickets with the auth "
                f"service's key, which stays on {spec.holder('auth')}: move the workers there, or run "
                "the contributor client (python3 agora_cli.py --headless --swarm URL) on this host"
            )


def _check_snapshot_source(spec: DeploySpec) -> None:
    server = spec.holder("snapshot_server")
    if spec.stores.snapshots_in_s3 and server is not None:
        raise ValueError(
            f"stores.snapshots is in S3, which serves joiners itself: remove snapshot_server from {server}"
        )
    if not spec.stores.snapshots_in_s3 and server is None:
        raise ValueError(
            "stores.snapshots is a directory: add a snapshot_server role to the host that holds it, "
            "or use an s3://bucket/prefix store"
        )
    if server is not None and spec.holder("workers") not in (None, server):
        raise ValueError(
            f"workers publish snapshots into the directory {spec.stores.snapshots} on "
            f"{spec.holder('workers')}, but {server} serves it: run snapshot_server on the same host"
        )


def load_spec(path: Path) -> DeploySpec:
    """The deploy file at ``path``; DeployError names each wrong field."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise DeployError(f"cannot read the deploy file {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise DeployError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise DeployError(f"{path} must hold a mapping (run, secrets, stores, hosts) at the top level")
    try:
        return DeploySpec.model_validate(data, context={"base": Path(path).resolve().parent})
    except ValidationError as error:
        raise DeployError(describe_validation_error(error, f"invalid deploy file {path}:")) from None


def chosen_host(spec: DeploySpec, name: str | None) -> str:
    """The host whose roles run here: ``--host NAME``, else the file's ``this_host``, else its only host."""
    name = name or spec.this_host or (next(iter(spec.hosts)) if len(spec.hosts) == 1 else None)
    if name is None:
        raise DeployError(
            f"the deploy file has {len(spec.hosts)} hosts: say which this is with --host "
            f"({', '.join(spec.hosts)}) or this_host in the file"
        )
    if name not in spec.hosts:
        raise DeployError(f"--host {name}: the deploy file has no such host; it has {', '.join(spec.hosts)}")
    return name
