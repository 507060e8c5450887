"""hivemind's RSA keys, as a peer whose identity lives in a file needs them.

hivemind makes an RSAPrivateKey only fresh (or by unpickling), and signs every DHT record of a process
(metrics, ProgressTracker) with ``RSAPrivateKey.process_wide()``, which has no setter. A libp2p identity file
and a peer id's public key are encoded with hivemind's copy of libp2p's crypto protobuf; ``write_identity_file``
writes one (mode 0600) for a DHT's ``identity_path``.
"""

from __future__ import annotations

import os
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

__all__ = [
    "encoded_identity",
    "encoded_public_key",
    "key_from_der",
    "rsa_der_of_identity",
    "use_as_process_key",
    "write_identity_file",
]


def key_from_der(der: bytes) -> RSAPrivateKey:
    """The RSAPrivateKey whose PKCS#1 DER bytes are ``der`` (cryptography raises ValueError if they are not)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # upstream's unpickling path: the key from its DER bytes
    return key


def use_as_process_key(key: RSAPrivateKey) -> None:
    """Make ``key`` hivemind's process-wide key, before anything signs with it (else a fresh key per process
    would give a new peer id on every run)."""
    with RSAPrivateKey._process_wide_key_lock:
        current = RSAPrivateKey._process_wide_key
        if current is not None and current.to_bytes() != key.to_bytes():
            raise RuntimeError("hivemind's process-wide key was already used before the peer key was loaded")
        RSAPrivateKey._process_wide_key = key


def encoded_identity(key: RSAPrivateKey) -> bytes:
    """``key`` as a libp2p identity file holds it (what ``identity_path`` of a DHT or P2P reads)."""
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def rsa_der_of_identity(identity: bytes) -> bytes:
    """The PKCS#1 DER bytes of the RSA key in a libp2p identity file's ``identity`` bytes; ValueError if it
    holds another kind of key (protobuf raises its own DecodeError on damaged bytes)."""
    decoded = crypto_pb2.PrivateKey.FromString(identity)
    if decoded.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError("not an RSA key")
    return decoded.data


def encoded_public_key(der: bytes) -> bytes:
    """An RSA public key (SubjectPublicKeyInfo DER) as libp2p encodes it before hashing it into a peer id."""
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()


def write_identity_file(path: Path | str, key: RSAPrivateKey | None = None) -> str:
    """Write ``key`` (default: hivemind's process-wide RSA key) as a libp2p identity file; return its peer id.

    A DHT started with ``identity_path=path`` then has this key's peer id, and every
    RSASignatureValidator of the process (the metrics one, ProgressTracker's default one)
    signs with that same key, so the monitor can tie each signature to the peer.
    """
    key = key or RSAPrivateKey.process_wide()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    identity = encoded_identity(key)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, identity)
    finally:
        os.close(descriptor)
    os.replace(temporary, path)
    return PeerID.from_identity(identity).to_base58()
