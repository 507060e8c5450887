"""The JSON the page reads beyond ``/leaderboard`` and ``/learning``: the swarm at the latest scrape (``/swarm``) and
one contributor (``/identities/<name>``). Peer ids appear, as in ``/peers/<id>``; peer addresses and tickets never
do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from agora_client.config import RunConfig
from agora_client.monitor.points import PFLOP, SECONDS_PER_HOUR
from agora_client.monitor.store import PointsStore


@dataclass(frozen=True)
class RunInfo:
    name: str
    model: str  # its shape in words


def run_info(config: RunConfig) -> RunInfo:
    model = config.model
    shape = (
        f"{model.n_layers} layers, d_model {model.d_model}, {model.n_heads} heads, vocab {model.vocab_size:,}, "
        f"{model.seq_len:,} tokens per sequence, {len(model.stages)} stages ({', '.join(model.stage_names)})"
    )
    return RunInfo(config.name, shape)


def swarm_view(store: PointsStore, run: RunInfo | None, now: float) -> dict[str, Any]:
    summary = store.summary()
    rows = store.leaderboard(now)
    return {
        "generated_at": now,
        "run": dataclasses.asdict(run) if run is not None else None,
        "contributors": len(rows),
        "online": sum(row.online for row in rows),
        "summary": dataclasses.asdict(summary) if summary is not None else None,
        "escrow": _escrow_view(store),
    }


def _escrow_view(store: PointsStore) -> dict[str, float]:
    """Compute that spot checks could not judge yet (held), lost (forfeited) and windows paid to neither side."""
    escrow = store.escrow()
    return {
        "held": escrow.held_flops / PFLOP,
        "forfeited": escrow.forfeited_flops / PFLOP,
        "disputed_windows": escrow.disputed_windows,
    }


def contributor_view(store: PointsStore, identity: str, now: float) -> dict[str, Any] | None:
    """One identity's standing, peers and points over time; None if the monitor never verified a peer of it."""
    row = next((row for row in store.leaderboard(now) if row.username == identity), None)
    if row is None:
        return None
    reasons = store.withheld_reasons()
    peers = sorted(
        (peer for peer in store.peers().values() if peer.identity == identity), key=lambda peer: peer.first_seen
    )
    return {
        "generated_at": now,
        "identity": identity,
        "standing": dataclasses.asdict(row),
        "presence": sum(peer.presence_points for peer in peers),
        "compute": sum(peer.compute_points for peer in peers),
        "withheld_compute": sum(peer.compute_flops / PFLOP for peer in peers if peer.withheld),
        "peers": [
            {
                "peer_id": peer.peer_id,
                "stage": peer.stage,
                "sync_phase": peer.sync_phase,
                "online": peer.online(now, store.policy),
                "active_hours": peer.presence_seconds / SECONDS_PER_HOUR,
                "presence": peer.presence_points,
                "compute": peer.compute_points,
                "claimed_compute": peer.claimed_points,
                "flagged": peer.over_claimed(store.policy),
                "withheld_compute": peer.compute_flops / PFLOP if peer.withheld else 0.0,
                "withheld_reason": reasons.get(peer.peer_id) if peer.withheld else None,
                # claimed compute that no trainer's receipt vouches for (not credited, whatever the reason)
                "unreceipted_compute": 0.0 if peer.withheld else peer.claimed_points - peer.compute_points,
                "first_seen": peer.first_seen,
                "last_seen": peer.last_seen,
            }
            for peer in peers
        ],
        "history": [[point.ts, point.presence, point.compute] for point in store.history(identity)],
    }
