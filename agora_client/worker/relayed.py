"""An operator's worker served through a relay: its reservation, signed with the key its DHT then runs on.

The relay holds ports only for reserves signed with the worker's libp2p key and carrying the auth service's pass or
ticket (``agora_client.relay.proof``). An operator's worker signs its own tickets (``--ticket-key``), so it reserves
with a ticket for its peer id; that peer id must be the DHT's, so the key (hivemind's process-wide one, which also
signs the worker's DHT records) is written as the identity file the DHT starts from.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from agora_client.auth.ticket_source import SelfIssuedTickets
from agora_client.engine.identity import write_identity_file
from agora_client.network import tcp_multiaddr
from agora_client.relay import KeptReservation, PeerCredentials


class RelayedPort:
    """A public port on a relay, reserved again after a loss, and the identity file of the key that reserved it;
    ``close()`` gives both back."""

    def __init__(self, reservation: KeptReservation, identity_path: Path):
        self.reservation, self.identity_path = reservation, identity_path

    @property
    def rtt_s(self) -> float | None:
        return self.reservation.rtt_s

    def dht_kwargs(self) -> dict:
        """Listen on the port the relay reaches, announce only the relay's address, run on the key that reserved."""
        return {
            "port": self.reservation.local_port,
            "announce_maddrs": [tcp_multiaddr(self.reservation.address)],
            "identity_path": str(self.identity_path),
        }

    def close(self) -> None:
        self.reservation.close()
        shutil.rmtree(self.identity_path.parent, ignore_errors=True)

    def __enter__(self) -> RelayedPort:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def reserve_relayed_port(
    relay: str,
    tickets: SelfIssuedTickets,
    *,
    on_lost: Callable[[str], None],
    on_restored: Callable[[str, bool], None],
) -> tuple[RelayedPort, str]:
    """Reserve a port on ``relay`` for a free local port, with a ticket for the process key's peer id; the
    reservation and its public address. RelayUnavailable says why not (nothing is left behind then)."""
    from hivemind.utils.crypto import RSAPrivateKey

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    identity_dir = Path(tempfile.mkdtemp(prefix="agora-relayed-"))
    key = RSAPrivateKey.process_wide()
    peer_id = write_identity_file(identity_dir / "identity.key", key)
    credentials = PeerCredentials(key, lambda: tickets.ticket_for(peer_id))
    reservation = KeptReservation(relay, port, on_lost=on_lost, on_restored=on_restored, credentials=credentials)
    try:
        address = reservation.open()
    except BaseException:
        shutil.rmtree(identity_dir, ignore_errors=True)
        raise
    return RelayedPort(reservation, identity_dir / "identity.key"), address
