"""The contributor's stable identity: one RSA key per GPU in the config dir, so the peer id survives restarts.

``<config dir>/identity/<gpu0|cpu>.key`` is a libp2p identity file (mode 0600), created on the first
run and reused on every later one. The auth service binds the peer id derived from it to the
Hugging Face account that first joined with it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.engine.identity import key_from_der, rsa_der_of_identity, write_identity_file


class PeerKeyError(ValueError):
    """The key file exists but cannot be used; the message says what to do."""


def key_path(config_dir: Path, device_name: str) -> Path:
    return Path(config_dir) / "identity" / f"{device_name}.key"


def load_or_create_peer_key(path: Path) -> RSAPrivateKey:
    """The key in ``path``, or a new one written there (mode 0600) on the first run."""
    path = Path(path)
    if not path.exists():
        key = RSAPrivateKey()
        write_identity_file(path, key)
        return key
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        os.chmod(path, 0o600)  # a key others can read is a key others can use
    try:
        der = rsa_der_of_identity(path.read_bytes())
        serialization.load_der_private_key(der, password=None)
    except Exception:  # protobuf and cryptography raise several unrelated types for a damaged file
        raise PeerKeyError(
            f"{path} is not a usable peer key; move it away to start with a new peer id "
            "(the swarm then sees a new peer, bound to the account you join with)"
        ) from None
    return key_from_der(der)


def peer_id_of(path: Path) -> str:
    return PeerID.from_identity(Path(path).read_bytes()).to_base58()
