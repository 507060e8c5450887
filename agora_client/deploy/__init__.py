"""The operator's deploy file: one YAML file for a swarm across hosts (spec), the roles each host runs (plan),
started and stopped (`agora deploy up` / `down`) or written as systemd units (`agora deploy units`).

The spec loads without hivemind; the plan and the secret store (seed keys, peer ids) are imported on first
use, so that `agora deploy down` starts at once.
"""

from importlib import import_module
from typing import Any

from .spec import DeployError, DeploySpec, chosen_host, load_spec

_LAZY = {
    "Launch": "agora_client.deploy.plan",
    "plan_roles": "agora_client.deploy.plan",
    "SecretStore": "agora_client.deploy.secrets",
    "prepare_secrets": "agora_client.deploy.secrets",
}

__all__ = ["DeployError", "DeploySpec", "chosen_host", "load_spec", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agora_client.deploy' has no attribute {name!r}")
