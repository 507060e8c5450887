"""A self-signed certificate authority and a server certificate it signs, made with ``cryptography`` for the tests."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    """The CA's certificate: what a client is told to trust."""
    server_cert: Path
    server_key: Path


def make_tls_files(directory: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """A CA, and a server certificate for ``hosts`` (IP addresses or names) signed by it.

    As PEM files in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Agora test swarm CA")])
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    names = [_subject_name(host) for host in hosts]
    server_cert = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), ca_name, server_key.public_key(), now)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    files.server_key.chmod(0o600)
    return files


def _builder(subject: x509.Name, issuer: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _subject_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
