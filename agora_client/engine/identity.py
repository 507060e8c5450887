"""hivemind's RSA keys, as a peer whose identity lives in a file needs them.

hivemind makes an RSAPrivateKey only fresh (or by unpickling), and signs every DHT record of a process
(metrics, ProgressTracker) with ``RSAPrivateKey.process_wide()``, which has no setter.
"""

from __future__ import annotations

from hivemind.utils.crypto import RSAPrivateKey

__all__ = ["key_from_der", "use_as_process_key"]


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
