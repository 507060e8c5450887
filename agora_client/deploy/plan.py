"""From the deploy file to the roles one host starts: each role's name, command line, ready line and address.

The plan is a list of steps; the launches of one step start together, and a step starts once the one before
it is ready: the seeds, then the snapshot server, relay, auth service and workers, then the monitor and the
trainers (both talk to the auth service). Seeds bootstrap from no one: every other peer is given all of them
(and seeds on other hosts are up in any order), so the DHT is one from the first peer on.
With the host's ``metrics:`` the roles without an HTTP port (seeds, relay, workers, trainers) each serve
Prometheus metrics on the next port from ``metrics.port``, in start order; the others serve them on their own.
Command lines come from ``agora_client.swarm.roles``, the local swarm's own rules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from agora_client.auth.tickets import load_signing_key, public_key_text
from agora_client.config import load_config
from agora_client.swarm import roles

from .secrets import SecretStore, own_trainers
from .spec import DeployError, DeploySpec, HostSpec


@dataclass(frozen=True)
class Launch:
    name: str
    args: tuple[str, ...]
    ready: str  # the role is up once it prints a line holding this
    address: str  # where others reach it: a multiaddr, a URL, HOST:PORT
    http_front: bool = False  # it answers GET /metrics on its own port


Step = tuple[Launch, ...]


def plan_roles(spec: DeploySpec, host_name: str, store: SecretStore) -> list[Step]:
    """Every step of ``host_name``'s roles, in order; DeployError when the file leaves something out."""
    host = spec.hosts[host_name]
    own_seeds = seed_multiaddrs(spec, host_name, store)
    seeds = [*own_seeds, *(seed for seed in spec.seeds if seed not in own_seeds)]
    if not seeds and any(getattr(host.roles, role) for role in ("auth", "monitor", "workers", "trainers")):
        raise DeployError(
            f"host {host_name} needs the seeds' multiaddrs, and runs no seed: list them under seeds: "
            f"in the deploy file (agora deploy up prints them on {spec.holder('seeds')})"
        )
    steps: list[Step] = [tuple(_seed(host, store, own_seeds, index) for index in range(len(own_seeds)))]
    services = [
        *_snapshot_server(spec, host),
        *_relay(host, store),
        *_auth(spec, host, store, seeds),
        *_workers(spec, host, store, seeds),
    ]
    followers = [*_monitor(spec, host, seeds), *_trainers(spec, host_name, store, seeds)]
    return _with_metrics_ports(host, [tuple(step) for step in (*steps, services, followers) if step])


def _with_metrics_ports(host: HostSpec, steps: list[Step]) -> list[Step]:
    """Each launch without an HTTP front gets the host's next metrics port (none without ``metrics:``)."""
    if host.metrics is None:
        return steps
    ports = iter(range(host.metrics.port, 65536))

    def served(launch: Launch) -> Launch:
        if launch.http_front:
            return launch
        port = next(ports, None)
        if port is None:
            raise DeployError(f"metrics.port {host.metrics.port} leaves no port for {launch.name}: pick a lower one")
        return replace(launch, args=(*launch.args, "--metrics-port", str(port), "--metrics-host", host.metrics.listen))

    return [tuple(served(launch) for launch in step) for step in steps]


def seed_multiaddrs(spec: DeploySpec, host_name: str, store: SecretStore) -> list[str]:
    """The multiaddrs of the seeds ``host_name`` runs: fixed by their ports and their keys in the secret store."""
    host = spec.hosts[host_name]
    if host.roles.seeds is None:
        return []
    first = host.roles.seeds.port
    return [
        f"/ip4/{host.address}/tcp/{first + index}/p2p/{store.seed_peer_id(index)}"
        for index in range(host.roles.seeds.count)
    ]


def _exposure(host: HostSpec) -> roles.ExposureArgs:
    tls = host.tls
    return roles.ExposureArgs(tls and tls.cert, tls and tls.key, host.trusted_proxies)


def _seed(host: HostSpec, store: SecretStore, own_seeds: list[str], index: int) -> Launch:
    port = host.roles.seeds.port + index
    args = roles.seed_args(host.address, [], port=port, identity=store.seed_key(index))
    return Launch(f"seed{index}", tuple(args), roles.SEED_READY, own_seeds[index])


def _snapshot_server(spec: DeploySpec, host: HostSpec) -> list[Launch]:
    role = host.roles.snapshot_server
    if role is None:
        return []
    args = roles.snapshot_server_args(Path(spec.stores.snapshots), host.address, role.port, _exposure(host))
    return [Launch("snapshot-server", tuple(args), roles.SNAPSHOTS_READY, host.url(role), http_front=True)]


def _relay(host: HostSpec, store: SecretStore) -> list[Launch]:
    role = host.roles.relay
    if role is None:
        return []
    try:  # the relay honours the auth service's relay passes: it needs that service's public key
        auth_public_key = public_key_text(load_signing_key(store.signing_key))
    except ValueError as error:
        raise DeployError(
            f"the relay needs the auth service's key to check its relay passes: {error}; deploy the auth host first "
            "and give this host the same secrets directory, as its workers need"
        ) from None
    args = roles.relay_args(host.address, role.port, host.address, role.ports, auth_public_key)
    return [Launch("relay", tuple(args), roles.RELAY_READY, f"{host.address}:{role.port}")]


def _auth(spec: DeploySpec, host: HostSpec, store: SecretStore, seeds: list[str]) -> list[Launch]:
    role = host.roles.auth
    if role is None:
        return []
    relay_host = spec.holder("relay")
    relays = (
        [] if relay_host is None else [f"{spec.hosts[relay_host].address}:{spec.hosts[relay_host].roles.relay.port}"]
    )
    args = roles.auth_args(
        preset=spec.run.config,
        state_dir=store.auth_state,
        host=host.address,
        port=role.port,
        seeds=seeds,
        snapshot_url=spec.snapshot_url(),
        token_file=role.token_file,
        pacing=role.pacing,
        max_workers_per_stage=role.max_workers_per_stage,
        stage_targets=role.stage_targets,
        monitor_url=spec.role_url("monitor"),
        relays=relays,
        exposure=_exposure(host),
    )
    return [Launch("auth", tuple(args), roles.AUTH_READY, host.url(role), http_front=True)]


def _monitor(spec: DeploySpec, host: HostSpec, seeds: list[str]) -> list[Launch]:
    role = host.roles.monitor
    if role is None:
        return []
    args = roles.monitor_args(
        preset=spec.run.config,
        seeds=seeds,
        auth_url=str(spec.role_url("auth")),
        db=spec.run.dir / "monitor" / "points.sqlite",
        host=host.address,
        port=role.port,
        interval=role.interval,
        exposure=_exposure(host),
    )
    return [Launch("monitor", tuple(args), roles.MONITOR_READY, host.url(role), http_front=True)]


def _workers(spec: DeploySpec, host: HostSpec, store: SecretStore, seeds: list[str]) -> list[Launch]:
    role = host.roles.workers
    if role is None:
        return []
    snapshots = spec.stores.snapshots
    launches = []
    for stage in load_config(spec.run.config).model.stage_names:
        for index in range(role.per_stage):
            args = roles.worker_args(
                stage=stage,
                index=index,
                preset=spec.run.config,
                host=host.address,
                seeds=seeds,
                ticket_key=store.signing_key,
                events=spec.run.dir / "events" / f"{stage}-{index}.jsonl",
                recover_from=None if spec.stores.snapshots_in_s3 else Path(snapshots),
                publish_to=snapshots if index == 0 else None,
                publish_every=role.publish_every,
                checkpoints=spec.stores.checkpoints if index == 0 else None,
                device=role.device,
            )
            launches.append(Launch(f"{stage}-{index}", tuple(args), roles.WORKER_READY, host.address))
    return launches


def _trainers(spec: DeploySpec, host_name: str, store: SecretStore, seeds: list[str]) -> list[Launch]:
    host, everyone = spec.hosts[host_name], spec.trainer_names()
    role, auth_url = host.roles.trainers, str(spec.role_url("auth"))
    launches = []
    for name in own_trainers(spec, host_name):
        args = roles.trainer_args(
            preset=spec.run.config,
            host=host.address,
            seeds=seeds,
            shard=f"{everyone.index(name)}/{len(everyone)}",
            tickets=roles.issued_tickets(store.trainer_credential(name), auth_url, role.insecure),
            report_every=role.report_every,
            checkpoints=spec.stores.checkpoints,
        )
        launches.append(Launch(name, tuple(args), roles.TRAINER_READY, host.address))
    return launches
