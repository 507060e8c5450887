"""How a service meets the internet: TLS of its own (``--tls-cert``/``--tls-key``), and the reverse proxies in front of
it whose ``X-Forwarded-For`` it believes (``--trusted-proxy``). The auth service and the monitor take the same flags."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from .forwarded import TrustedProxies
from .tls import TlsSetupError, server_tls_context


@dataclass(frozen=True)
class Exposure:
    tls: ssl.SSLContext | None = None
    """Serve HTTPS with this context; None: plain HTTP (on loopback, or behind a proxy that ends TLS)."""
    trusted_proxies: TrustedProxies = field(default_factory=TrustedProxies)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


PLAIN_HTTP = Exposure()  # every service's default: no TLS of its own, no trusted proxies


def add_exposure_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PEM",
        help="serve HTTPS with this certificate (the server's own first, then its chain); needs --tls-key",
    )
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="the unencrypted private key of --tls-cert")
    parser.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        dest="trusted_proxies",
        metavar="ADDR_OR_CIDR",
        help="a reverse proxy in front of this service (repeatable): X-Forwarded-For is believed from it alone, so "
        "client addresses (dial-backs, rate limits, logs) are the clients' own, not the proxy's",
    )


def exposure_from_arguments(args: argparse.Namespace) -> Exposure:
    """The exposure the flags ask for; ValueError (TlsSetupError) says what to fix."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise TlsSetupError(
            "give both --tls-cert and --tls-key, or neither (plain HTTP, for loopback or behind a TLS proxy)"
        )
    tls = server_tls_context(args.tls_cert, args.tls_key) if args.tls_cert is not None else None
    return Exposure(tls, TrustedProxies.parse(args.trusted_proxies))
