"""Joining the swarm's DHT: bootstrap from whichever seed answers."""

from __future__ import annotations

from typing import Sequence

from hivemind import DHT

from agora_client.discovery.validators import record_validators


class NoSeedAnswered(RuntimeError):
    pass


def connect_dht(seeds: Sequence[str], *, host: str = "127.0.0.1", port: int = 0, **kwargs) -> DHT:
    """Start a DHT peer bootstrapped from the seeds; any one live seed is enough.

    It runs the swarm's record validators (``record_validators()``) unless the caller passes its own list.
    """
    host_maddrs = [f"/ip4/{host}/tcp/{port}"]
    kwargs.setdefault("record_validators", record_validators())
    # libp2p's own UPnP mapping says nothing about whether it worked; a contributor's client maps the port itself
    kwargs.setdefault("nat_port_map", False)
    try:
        return DHT(initial_peers=list(seeds), host_maddrs=host_maddrs, start=True, **kwargs)
    except Exception as error:  # hivemind raises plain errors when no initial peer is reachable
        raise NoSeedAnswered(
            f"could not join the swarm through any of {len(seeds)} seed(s) ({error}); "
            "check that a seed is running and its multiaddr is right"
        ) from None
