"""The deploy file's secret store (``secrets:``, mode 0700): what each host's roles need and nobody else may read.

    <secrets>/auth/                     the auth service's state dir: signing key, token-hash secret, trainer
                                        credentials' hashes, slots (auth host only)
    <secrets>/seeds/seed<i>.key         each seed's libp2p key, so that its multiaddr never changes
    <secrets>/trainers/<name>.credential a trainer's credential (mode 0600), made on the auth host; copy a
                                        trainer host's own files there before `agora deploy up` on it

Roles get these as file paths, never as values on a command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from agora_client.auth.tickets import load_or_create_signing_key
from agora_client.auth.trainer_credentials import TrainerCredentials
from agora_client.joining.peer_key import load_or_create_peer_key, peer_id_of

from .spec import DeployError, DeploySpec, trainer_name


@dataclass(frozen=True)
class SecretStore:
    root: Path

    @property
    def auth_state(self) -> Path:
        return self.root / "auth"

    @property
    def signing_key(self) -> Path:
        return self.auth_state / "signing_key.pem"  # where the auth service keeps it in its state dir

    def seed_key(self, index: int) -> Path:
        return self.root / "seeds" / f"seed{index}.key"

    def seed_peer_id(self, index: int) -> str:
        return peer_id_of(self.seed_key(index))

    def trainer_credential(self, name: str) -> Path:
        return self.root / "trainers" / f"{name}.credential"


def prepare_secrets(spec: DeploySpec, host_name: str) -> SecretStore:
    """Create what ``host_name``'s roles need and is missing (keys, credentials); DeployError for what only the
    operator can bring (a trainer's credential made on another host)."""
    store, roles = SecretStore(spec.secrets), spec.hosts[host_name].roles
    store.root.mkdir(parents=True, exist_ok=True)
    os.chmod(store.root, 0o700)
    if roles.auth is not None:
        load_or_create_signing_key(store.signing_key)
        _issue_trainer_credentials(spec, store)
    if roles.seeds is not None:
        for index in range(roles.seeds.count):
            store.seed_key(index).parent.mkdir(mode=0o700, exist_ok=True)
            load_or_create_peer_key(store.seed_key(index))
    for name in own_trainers(spec, host_name):
        if not store.trainer_credential(name).is_file():
            raise DeployError(
                f"trainer {name} has no credential at {store.trainer_credential(name)}: copy that file from the "
                f"secret store of {spec.holder('auth')} (agora deploy up made it there), mode 0600"
            )
    return store


def own_trainers(spec: DeploySpec, host_name: str) -> list[str]:
    trainers = spec.hosts[host_name].roles.trainers
    return [] if trainers is None else [trainer_name(host_name, index) for index in range(trainers.count)]


def _issue_trainer_credentials(spec: DeploySpec, store: SecretStore) -> None:
    """A credential for every trainer of the file that has none yet; its token goes to a file, never to the console."""
    credentials = TrainerCredentials(store.auth_state)
    for name in spec.trainer_names():
        path = store.trainer_credential(name)
        if path.is_file():
            continue
        try:
            token = credentials.add(name)
        except ValueError:
            raise DeployError(
                f"the trainer credential {name} was made before, but its file {path} is gone: put it back (from the "
                f"trainer's host), or revoke it (agora trainer-credential revoke {name} --state-dir "
                f"{store.auth_state}) and give the trainer's host another name in the deploy file"
            ) from None
        path.parent.mkdir(mode=0o700, exist_ok=True)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(token.reveal() + "\n")
