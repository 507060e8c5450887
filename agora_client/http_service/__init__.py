"""The services' HTTP front: a synchronous request handler put on aiohttp behind guards that hold up on the internet.

A header read timeout and caps on open connections (overall and per client address) act on each connection
before aiohttp parses it (``guard``); a body read timeout, a body size limit, per-address rate limits on chosen
routes and a bounded handler pool act on each request (``service``). The auth service, the monitor's API and
the snapshot server all run on it. TLS and trusted reverse proxies (``X-Forwarded-For``) come with ``Exposure``
(``exposure``, ``tls``, ``forwarded``).
"""

from .exposure import PLAIN_HTTP, Exposure, add_exposure_arguments, exposure_from_arguments
from .forwarded import TrustedProxies
from .limits import RateLimit, ServiceLimits, raise_open_file_limit
from .messages import Reply, Request, json_reply
from .service import HttpService
from .tls import TlsSetupError, server_tls_context

__all__ = [
    "Exposure",
    "HttpService",
    "PLAIN_HTTP",
    "RateLimit",
    "Reply",
    "Request",
    "ServiceLimits",
    "TlsSetupError",
    "TrustedProxies",
    "add_exposure_arguments",
    "exposure_from_arguments",
    "json_reply",
    "raise_open_file_limit",
    "server_tls_context",
]
