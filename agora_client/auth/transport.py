"""How the client reaches the swarm's services: never plain ``http://`` across the internet unless the contributor
says ``--insecure``, and over HTTPS trusting the usual certificate authorities (or ``SSL_CERT_FILE``'s) plus, with
``--ca-cert``, the swarm's own.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import certifi
import httpx

TOKEN_IN_CLEAR = "your Hugging Face token would cross the internet in clear text, for anyone on the way to read and use"
WEIGHTS_IN_CLEAR = "the stage's weights would come unauthenticated: anyone on the way could swap them"
POINTS_IN_CLEAR = "what it says of your points would come unauthenticated: anyone on the way could change it"


class PlainHttpRefused(ValueError):
    """A plain ``http://`` URL to a host on the internet, without ``--insecure``.

    The message says why and what to do."""


class CaCertificateError(ValueError):
    """The ``--ca-cert`` file cannot be trusted as a certificate authority; the message says what to give instead."""


def refuse_plain_http(url: str, *, insecure: bool, what: str, why: str) -> None:
    """Raise PlainHttpRefused if ``url`` is plain http:// to a host outside loopback and the private address ranges.

    ``what`` names the service (``the swarm's auth service``), ``why`` says what plain HTTP would cost there.
    """
    parts = urlsplit(url)
    if insecure or parts.scheme != "http" or parts.hostname is None or _on_a_private_network(parts.hostname):
        return
    raise PlainHttpRefused(
        f"refusing plain http:// to {what} at {parts.hostname}, which is neither this machine nor a private network: "
        f"{why}. Use its https:// address (ask the swarm's operator), or pass --insecure to accept the risk"
    )


def _on_a_private_network(host: str) -> bool:
    """True for loopback and private addresses, and names that resolve only to them.

    Private: RFC 1918, unique-local, link-local."""
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:  # a name: what it resolves to decides (an unresolvable name is taken as on the internet)
            addresses = [ipaddress.ip_address(info[4][0].partition("%")[0]) for info in socket.getaddrinfo(host, None)]
        except (OSError, UnicodeError, ValueError):
            return False
    addresses = [getattr(address, "ipv4_mapped", None) or address for address in addresses]  # ::ffff:a.b.c.d is a.b.c.d
    return bool(addresses) and all(address.is_loopback or address.is_private for address in addresses)


def trust_ca_certificate(ca_cert: Path, bundle: Path) -> None:
    """Make every HTTPS client this process makes from now on trust ``ca_cert`` besides the CAs it trusted already.

    httpx (and OpenSSL's defaults) read SSL_CERT_FILE each time a client is made: one bundle there, of the CAs trusted
    so far and this one, reaches every call to the swarm (run description, tokenizer, join, renew, leave, snapshots,
    monitor) without threading an SSL context through each. ``bundle`` is where that file is written.
    """
    try:
        trusted = ssl.create_default_context(cafile=str(ca_cert)).cert_store_stats()["x509"]
    except (OSError, ssl.SSLError) as error:
        raise CaCertificateError(
            f"--ca-cert {ca_cert} cannot be read as PEM certificates ({getattr(error, 'strerror', None) or error}): "
            "give the swarm's CA certificate in PEM, as its operator hands it out"
        ) from None
    if not trusted:
        raise CaCertificateError(f"--ca-cert {ca_cert} holds no certificate: give the swarm's CA certificate in PEM")
    already = Path(os.environ.get("SSL_CERT_FILE") or certifi.where()).read_bytes()
    bundle.parent.mkdir(parents=True, exist_ok=True)
    partial = bundle.with_name(f".{bundle.name}.{os.getpid()}")  # runtimes of several GPUs may write it at once
    partial.write_bytes(already.rstrip(b"\n") + b"\n" + ca_cert.read_bytes())
    os.replace(partial, bundle)
    os.environ["SSL_CERT_FILE"] = str(bundle)


def connection_failure(error: httpx.HTTPError) -> str:
    """Why a request failed, in words safe for a log: the error's class, or what to do about an untrusted certificate.

    Never the error's own text, which may quote the request (and a join's request carries the token).
    """
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return (
                f"its TLS certificate is not trusted: {cause.verify_message}; if the swarm uses a certificate of its "
                "own, pass its CA certificate with --ca-cert PEM (or set SSL_CERT_FILE)"
            )
        cause = cause.__cause__ or cause.__context__
    return type(error).__name__
