"""Relay: a small TCP reverse tunnel for workers behind NATs that no port mapping can open.

Carrier-grade NAT and routers that refuse UPnP leave some contributors' workers unreachable, yet trainers and
stage peers must connect to them. hivemind's libp2p circuit relay would carry those connections, but it cuts
each relayed connection after 128 KiB or 2 minutes (measured), which is useless for activations. So the
swarm's operator runs this relay instead: a worker keeps a control connection to it and gets a public port;
each connection to that port is spliced to a fresh connection the worker opens back to the relay.

The relay only moves opaque bytes: libp2p's own TLS/Noise handshake authenticates the worker's peer id end to
end and encrypts everything, so the relay can read nothing. It holds ports only for joiners the auth service sent
to it: a reserve carries the service's relay pass (or ticket) and is signed with the worker's own key.

- ``protocol``: the newline-delimited JSON messages and their bounds;
- ``proof``: the pass and the signature a reserve carries (``PeerCredentials``), and their check;
- ``server``: ``RelayServer`` (asyncio, in a background thread) and its ``RelaySettings``;
- ``client``: ``RelayReservation``, the worker's side: reserve a public port and serve its connections;
- ``kept``: ``KeptReservation``, a reservation reserved again (the same port, if free) after a loss;
- ``main``: the `agora relay` command.
"""

from .client import RelayReservation, RelayUnavailable
from .kept import KeptReservation
from .proof import PeerCredentials
from .server import RelayServer, RelaySettings, ReservationInfo

__all__ = [
    "KeptReservation",
    "PeerCredentials",
    "RelayReservation",
    "RelayServer",
    "RelaySettings",
    "RelayUnavailable",
    "ReservationInfo",
]
