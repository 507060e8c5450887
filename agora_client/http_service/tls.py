"""The services' TLS: a server context from the operator's PEM certificate and key, TLS 1.2 at least."""

from __future__ import annotations

import ssl
from pathlib import Path


class TlsSetupError(ValueError):
    """The certificate or key cannot serve TLS; the message says which and what to give instead."""


def server_tls_context(certificate: Path, key: Path) -> ssl.SSLContext:
    """A server context presenting ``certificate`` (PEM, the leaf first, then its chain) signed by ``key`` (PEM)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        # A password callback: without one OpenSSL would ask for an encrypted key's password on the terminal.
        context.load_cert_chain(certificate, key, password=_no_password)
    except FileNotFoundError as error:
        raise TlsSetupError(
            f"no such file: {error.filename}; give --tls-cert and --tls-key as paths to PEM files"
        ) from None
    except (ssl.SSLError, OSError) as error:
        raise TlsSetupError(
            f"cannot serve TLS with certificate {certificate} and key {key} ({error.strerror or error}): give the PEM "
            "certificate (the server's own first, then its chain) and the unencrypted PEM private key that matches it"
        ) from None
    return context


def _no_password() -> bytes:
    raise TlsSetupError(
        "the TLS private key is encrypted: give it unencrypted (openssl pkey -in KEY -out PLAIN), mode 0600"
    )
