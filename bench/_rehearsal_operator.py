"""The rehearsal's operator side (bench/rehearsal.py), as an operator runs it: one deploy file for the operator's
host (seeds, snapshot server, relay, auth with token-file identities, monitor, two workers per stage) and the
trainers' host (two trainers), TLS from a CA made for the run, `agora deploy up --detach` on each host in its
own namespace, `agora deploy firewall --apply` on the operator's, `agora deploy down` on both at the end.

The roles that call the auth service over HTTPS (monitor, trainers) trust the run's CA through ``SSL_CERT_FILE``
(the usual CAs plus the run's), set in the environment `deploy up` runs in, as an operator with a private CA would.
The trainers' host runs no seed: its deploy file lists the seeds' multiaddrs that `deploy up` printed on the
operator's host, and it takes its trainer credentials from the secret store the operator's `up` filled.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import certifi
import httpx
import yaml

from agora_client.auth.identity import write_demo_token_file
from agora_client.auth.state_store import STATE_DB
from agora_client.deploy.secrets import SecretStore
from agora_client.deploy.state import read_state
from agora_client.swarm.processes import CLI
from tests.netns import Host
from tests.tls_helpers import make_tls_files

AUTH_PORT, MONITOR_PORT, SNAPSHOT_PORT, RELAY_PORT, METRICS_PORT = 8440, 8090, 8080, 47100, 9400
SEED_COUNT, TRAINER_COUNT = 2, 2
# two honest workers in every stage, whatever the homes do: a disagreement with the liar, whichever stage the auth
# service gives it, has a referee
OPERATOR_WORKERS_PER_STAGE = 2
UP_TIMEOUT_S = 420.0
DOWN_TIMEOUT_S = 120.0
SEED_LINE = re.compile(r"^\[DEPLOY\] seed\d+ ready: (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class OperatorFiles:
    deploy_file: Path
    ca_cert: Path  # what contributors pass with --ca-cert
    ca_bundle: Path  # the usual CAs and the run's: SSL_CERT_FILE of the roles
    tokens: dict[str, str]  # contributor -> its token (token-file identity)
    run_dir: Path  # the deploy file's run.dir: logs, events, the monitor's database
    checkpoints: Path  # the deploy file's checkpoint store: the first worker of each stage writes its sets there
    server_cert: Path  # the services' TLS certificate (a visitor's browser trusts its key)
    auth_state: Path  # the auth service's state database: slots, queue places, peer bindings


def _spec(root: Path, operator: Host, trainers: Host, config: str, seeds: list[str]) -> dict:
    tls = make_tls_files(root / "tls", hosts=(operator.address,))
    return {
        "run": {"config": config, "dir": str(root / "run")},
        "secrets": str(root / "secrets"),
        "stores": {"snapshots": str(root / "snapshots"), "checkpoints": str(root / "checkpoints")},
        "seeds": seeds,
        "hosts": {
            "operator": {
                "address": operator.address,
                "tls": {"cert": str(tls.server_cert), "key": str(tls.server_key)},
                "metrics": {"port": METRICS_PORT, "listen": operator.address},
                "roles": {
                    "seeds": {"count": SEED_COUNT},
                    "snapshot_server": {"port": SNAPSHOT_PORT},
                    "relay": {"port": RELAY_PORT},
                    "auth": {
                        "port": AUTH_PORT,
                        "identity": "token-file",
                        "token_file": str(root / "secrets" / "tokens.json"),
                        "pacing": 1.0,
                    },
                    "monitor": {"port": MONITOR_PORT, "interval": 5.0},
                    "workers": {"per_stage": OPERATOR_WORKERS_PER_STAGE, "publish_every": 1, "device": "cpu"},
                },
            },
            "trainers": {
                "address": trainers.address,
                "metrics": {"port": METRICS_PORT, "listen": trainers.address},
                "roles": {"trainers": {"count": TRAINER_COUNT, "report_every": 5.0}},
            },
        },
    }


def prepare(root: Path, operator: Host, trainers: Host, config: str, users: list[str]) -> OperatorFiles:
    """The deploy file, the run's CA and server certificate, the CA bundle and the contributors' tokens."""
    root.mkdir(parents=True, exist_ok=True)
    deploy_file = root / "deploy.yaml"
    deploy_file.write_text(yaml.safe_dump(_spec(root, operator, trainers, config, [])))
    bundle = root / "tls" / "bundle.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes() + (root / "tls" / "ca.pem").read_bytes())
    (root / "secrets").mkdir(mode=0o700, exist_ok=True)
    tokens = {user: write_demo_token_file(root / "secrets" / "tokens.json", user) for user in users}
    return OperatorFiles(
        deploy_file,
        root / "tls" / "ca.pem",
        bundle,
        tokens,
        root / "run",
        root / "checkpoints",
        root / "tls" / "server.pem",
        SecretStore(root / "secrets").auth_state / STATE_DB,
    )


def _deploy(files: OperatorFiles, host: Host, *args: str, timeout: float) -> subprocess.CompletedProcess:
    with host.entered():  # the roles start in the host's namespace, where the command runs
        return subprocess.run(
            [*CLI, "deploy", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "SSL_CERT_FILE": str(files.ca_bundle)},
        )


def _checked(result: subprocess.CompletedProcess, what: str) -> str:
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout


def start_operator(files: OperatorFiles, operator: Host) -> str:
    """`deploy up --detach` and `deploy firewall --apply` on the operator's host; what `up` printed."""
    printed = _checked(
        _deploy(files, operator, "up", str(files.deploy_file), "--host", "operator", "--detach", timeout=UP_TIMEOUT_S),
        "deploy up on the operator's host",
    )
    _checked(
        _deploy(files, operator, "firewall", str(files.deploy_file), "--host", "operator", "--apply", timeout=60),
        "deploy firewall --apply",
    )
    return printed


def start_trainers(files: OperatorFiles, trainers: Host, operator_printed: str) -> str:
    """The seeds' multiaddrs (as `up` printed them) go into the deploy file; then `deploy up` on the trainers' host."""
    spec = yaml.safe_load(files.deploy_file.read_text())
    spec["seeds"] = SEED_LINE.findall(operator_printed)
    if len(spec["seeds"]) != SEED_COUNT:
        raise RuntimeError(f"deploy up printed {len(spec['seeds'])} seed addresses, not {SEED_COUNT}")
    files.deploy_file.write_text(yaml.safe_dump(spec))
    return _checked(
        _deploy(files, trainers, "up", str(files.deploy_file), "--host", "trainers", "--detach", timeout=UP_TIMEOUT_S),
        "deploy up on the trainers' host",
    )


def stop_host(files: OperatorFiles, host: Host, name: str) -> str:
    """`deploy down` on one host; what it said (it is not an error when nothing runs)."""
    result = _deploy(files, host, "down", str(files.deploy_file), "--host", name, timeout=DOWN_TIMEOUT_S)
    return (result.stdout + result.stderr).strip()


def urls(operator: Host) -> dict[str, str]:
    base = f"https://{operator.address}"
    return {"auth": f"{base}:{AUTH_PORT}", "monitor": f"{base}:{MONITOR_PORT}", "snapshots": f"{base}:{SNAPSHOT_PORT}"}


def metrics_endpoints(operator: Host, trainers: Host, stages: tuple[str, ...]) -> dict[str, tuple[Host, str]]:
    """Every Prometheus endpoint of both hosts: name -> (the host to scrape from, its URL).

    The roles without an HTTP port take the host's metrics ports in start order (agora_client/deploy/plan.py):
    on the operator's host the seeds, the relay, then the workers, stage by stage; on the trainers' host the
    trainers."""
    workers = [f"{stage}-{i}" for stage in stages for i in range(OPERATOR_WORKERS_PER_STAGE)]
    plain = [*(f"seed{i}" for i in range(SEED_COUNT)), "relay", *workers]
    endpoints = {
        name: (operator, f"http://{operator.address}:{METRICS_PORT + i}/metrics") for i, name in enumerate(plain)
    }
    endpoints |= {name: (operator, f"{url}/metrics") for name, url in urls(operator).items()}  # HTTP roles
    endpoints |= {
        f"trainer{i}": (trainers, f"http://{trainers.address}:{METRICS_PORT + i}/metrics") for i in range(TRAINER_COUNT)
    }
    return endpoints


def crash_role(files: OperatorFiles, host_name: str, role: str) -> None:
    """SIGKILL one role and all it started, as a crash would; return once its host's `deploy up` has started it
    again (a new process group, ready), as it does a failed role."""
    path = files.run_dir / f"deploy-{host_name}.json"
    state = read_state(path)
    if state is None:
        raise RuntimeError(f"nothing runs from the deploy file on {host_name}")
    pgid = next(entry["pgid"] for entry in state["roles"] if entry["name"] == role)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + UP_TIMEOUT_S
    while True:
        state = read_state(path) or {"ready": False, "roles": []}
        now = next((entry["pgid"] for entry in state["roles"] if entry["name"] == role), pgid)
        if state["ready"] and now != pgid:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"deploy up on {host_name} did not start {role} again within {UP_TIMEOUT_S:.0f}s")
        time.sleep(0.5)


def auth_status(files: OperatorFiles, operator: Host) -> dict | None:
    """The auth service's GET /v1/status (None when it does not answer)."""
    with operator.entered():
        try:
            return httpx.get(f"{urls(operator)['auth']}/v1/status", verify=str(files.ca_cert), timeout=15).json()
        except (httpx.HTTPError, ValueError):
            return None


def leaderboard(files: OperatorFiles, operator: Host, reader: Host | None = None) -> list[dict] | None:
    """The monitor's leaderboard rows, read from ``reader``'s namespace (default: the operator's); None when it does
    not answer."""
    with (reader or operator).entered():
        try:
            return httpx.get(f"{urls(operator)['monitor']}/leaderboard", verify=str(files.ca_cert), timeout=15).json()[
                "rows"
            ]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
