"""Every way a stranger could game the swarm (issue 46), run against the real parts, with what each cheat earned.

- points: a worker that rotates run ids, resets its counters, claims phase 2 in phase 1, or replays old records,
  each beside an honest twin doing the same real work, credited by the monitor's own store (bench/_gaming_presence.py);
- unjudged compute: a liar in a two-worker stage, in a stage still calibrating and in an unverifiable one, beside
  honest workers, through the trainer's real balancer, spot checks, receipts and escrow (bench/escrow.py);
- the relay: a reservation without a relay pass, and another peer asking for a held port, against a real relay;
- probes: a stranger's uplink probe, between real hivemind peers;
- tokens: a write-scoped token and a fine-grained one with write rights, against a local stand-in of whoami-v2;
- open defaults: a worker started without an auth key and without ``--open`` (a real ``agora worker``);
- one address holding 1,000 half-open connections against a real auth service with a 1,024 open-file limit.

Ends with one JSON line: ``max_cheat_ratio`` (the most any cheat earned over what its honest twin earned in the same
time; target <= 1.0), ``honest_paid_ratio`` (the least an honest peer was credited over the work it did; target
>= 0.9), ``refused`` (each attack, true when it was refused or earned nothing extra) and
``honest_escrow_release_s`` (the longest honest compute waited in escrow).

    python3 bench/gaming.py   # takes minutes
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _gaming_presence  # noqa: E402
import escrow  # noqa: E402

from agora_client.config import load_config  # noqa: E402
from agora_client.token_scope import TokenRefused, check_token_scope  # noqa: E402
from tests.half_open import HELD, HONEST_REQUESTS, HalfOpenAttacker, honest_request, start_service, stop_service  # noqa: E402
from tests.whoami_stand_in import whoami_stand_in  # noqa: E402

UNREACHABLE_SEED = "/ip4/127.0.0.1/tcp/1"


# Stages spot checks cannot judge on their own, each with one liar (bench/escrow.py's simulated stage, tiny's checks)
UNJUDGED_STAGES = {
    "liar_two_worker_stage": {"workers": 1, "liars": 1, "references": 1},  # decided by the operator's reference
    "liar_during_calibration": {"workers": 2, "liars": 1},
    "liar_unverifiable_stage": {"workers": 2, "liars": 1, "drift": 2.0},  # honest replicas as far apart as noise
}
ESCROW_RELEASE_TARGET_S = 900.0  # an honest joiner of a new stage sees its compute confirmed within a quarter hour


def unjudged_compute() -> tuple[dict[str, float], float, float | None]:
    """Each liar's pay over its honest stage-mates' (0 when it was paid nothing), the honest workers' paid share on
    a stage of three honest workers, and the longest their compute waited in escrow there."""
    config = load_config("tiny").spot_checks
    ratios = {}
    for name, stage in UNJUDGED_STAGES.items():
        paid = escrow.measure(config, **stage)["paid"]
        honest = [flops for peer, flops in paid.items() if peer.startswith("honest")]
        ratios[name] = paid["liar0"] / (sum(honest) / len(honest)) if paid["liar0"] else 0.0
    honest = escrow.measure(config, workers=3)
    return ratios, honest["honest_paid_ratio"], honest["honest_escrow_release_s"]


def token_attacks() -> dict[str, bool]:
    """Whether the client refuses to send each write-capable token to a swarm."""
    refused = {}
    with whoami_stand_in() as endpoint:
        for name, token in (("write_token", "hf_write12345678"), ("fine_grained_write_token", "hf_grainedwrite1")):
            try:
                check_token_scope(token, allow_write=False, endpoint=endpoint)
                refused[name] = False
            except TokenRefused:
                refused[name] = True
    return refused


def relay_attacks(scratch: Path) -> dict[str, bool]:
    """Against a real ``agora relay``: a reservation without a relay pass, and another peer asking for the port a
    dropped worker held (whose owner then takes it back with its own key)."""
    from hivemind.utils.crypto import RSAPrivateKey

    from agora_client.auth.relay_pass import issue_relay_pass
    from agora_client.auth.tickets import generate_signing_key, public_key_text
    from agora_client.relay import PeerCredentials, RelayReservation, RelayUnavailable

    auth_key = generate_signing_key()

    def holder(key: RSAPrivateKey, with_pass: bool = True) -> PeerCredentials:
        peer_id = PeerCredentials(key, lambda: "").peer_id
        relay_pass = issue_relay_pass(auth_key, identity=peer_id[-8:], peer_id=peer_id, ttl_s=600.0)
        return PeerCredentials(key, (lambda: relay_pass) if with_pass else (lambda: ""))

    def reserve(credentials: PeerCredentials | None, port: int | None = None) -> str | None:
        try:
            with RelayReservation(control, 9, on_lost=print, credentials=credentials) as reservation:
                return reservation.open(port=port)
        except RelayUnavailable:
            return None

    low = 47000
    command = [sys.executable, str(ROOT / "agora_cli.py"), "relay", "--host", "127.0.0.1", "--port", "0"]
    command += ["--public-host", "127.0.0.1", "--ports", f"{low}-{low + 30}", "--auth-public-key"]
    log = (scratch / "relay.log").open("w")  # its refusals, each with its reason
    relay = subprocess.Popen(
        [*command, public_key_text(auth_key)], cwd=scratch, stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        ready = relay.stdout.readline()  # "[RELAY] listening on 127.0.0.1:PORT for public ..."
        if not ready.startswith("[RELAY] listening on"):
            raise RuntimeError(f"the relay did not start: {ready!r}")
        control = ready.split()[3]
        owner, squatter = RSAPrivateKey(), RSAPrivateKey()
        without_pass = reserve(holder(squatter, with_pass=False)) is None and reserve(None) is None
        held = reserve(holder(owner))  # the owner drops: its port is held for it
        port = int(held.rpartition(":")[2]) if held else None
        squatter_refused = held is not None and reserve(holder(squatter), port=port) is None
        return {
            "relay_reservation_without_pass": without_pass,
            "relay_held_port_to_another_peer": squatter_refused and reserve(holder(owner), port=port) == held,
        }
    finally:
        relay.terminate()
        relay.wait(timeout=30)
        log.close()


def stranger_probe() -> bool:
    """A peer with a valid ticket for the stage, outside the sink's latest averaging group, sends an uplink probe
    between real hivemind peers: refused before the sink reads it. A groupmate's probe still measures."""
    from hivemind import DHT

    from agora_client.auth.ticket_source import SelfIssuedTickets
    from agora_client.auth.tickets import generate_signing_key
    from agora_client.averaging.group_admission import GroupAdmission
    from agora_client.averaging.probe_admission import GroupProbeAdmission
    from agora_client.engine.expert_calls import close_replica, replicate_p2p
    from agora_client.engine.uplink_probe import ProbeFailed, probe_uplink, serve_uplink_probes
    from agora_client.serving.rejections import RejectionLog
    from agora_client.serving.ticket_gate import TicketGate

    key, stage = generate_signing_key(), "body1"

    def admission() -> GroupAdmission:
        tickets = SelfIssuedTickets(key, role="worker", stage=stage)
        gate = TicketGate(tickets.public_key, roles=("worker",), stage=stage)
        return GroupAdmission(gate, tickets, RejectionLog(lambda line: None))

    sink_dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    seeds = [str(address) for address in sink_dht.get_visible_maddrs()]
    dhts = [sink_dht, *(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=seeds) for _ in "ms")]
    p2ps = [replicate_p2p(dht) for dht in dhts]
    try:
        sink, member, stranger = (dht.peer_id.to_base58() for dht in dhts)
        gate = GroupProbeAdmission(sink, admission())
        gate.grouped_with([sink, member])
        serve_uplink_probes(p2ps[0], gate, deadline_s=10.0)

        def probe(index: int, peer: str) -> float | None:
            ticket = admission().credentials(peer)["ticket"].encode("ascii")
            try:
                return probe_uplink(p2ps[index], sink, 1 << 20, 60.0, ticket=ticket)
            except ProbeFailed:
                return None

        return probe(2, stranger) is None and probe(1, member) is not None
    finally:
        for p2p in p2ps:
            close_replica(p2p)
        for dht in dhts:
            dht.shutdown()


def keyless_worker(scratch: Path) -> bool:
    """A worker without the auth service's key refuses to start unless told --open."""
    started = subprocess.run(
        [sys.executable, str(ROOT / "agora_cli.py"), "worker", "--stage", "head", "--seeds", UNREACHABLE_SEED],
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return started.returncode == 2 and "--open" in started.stderr


def half_open(scratch: Path) -> dict:
    """The share of honest requests answered while one address holds HELD half-open connections."""
    service, port = start_service(scratch, 1024, 1024)
    try:
        with HalfOpenAttacker(port):
            answered = sum(honest_request(port) for _ in range(HONEST_REQUESTS))
    finally:
        stop_service(service)
    return {"held": HELD, "honest_answered": answered / HONEST_REQUESTS}


def main() -> int:
    import tempfile

    started = time.monotonic()
    refused: dict[str, bool] = {}
    cheat_ratios: dict[str, float] = {}
    paid_ratios: list[float] = []
    for result in _gaming_presence.measure():
        print(f"points  {result['attack']:<20} cheat earned {result['cheat_ratio']:.3f} of its honest twin", flush=True)
        cheat_ratios[result["attack"]] = result["cheat_ratio"]
        refused[result["attack"]] = result["cheat_ratio"] <= 1.0
        paid_ratios.append(result["honest_paid_ratio"])
    liar_ratios, escrow_paid, release_s = unjudged_compute()
    for name, ratio in liar_ratios.items():
        print(f"escrow  {name:<24} liar paid {ratio:.3f} of an honest stage-mate", flush=True)
        cheat_ratios[name] = ratio
        refused[name] = ratio <= 1.0
    paid_ratios.append(escrow_paid)
    print(f"escrow  honest compute waited at most {release_s} s (target {ESCROW_RELEASE_TARGET_S:g})", flush=True)
    for name, was_refused in token_attacks().items():
        print(f"tokens  {name:<20} refused: {was_refused}", flush=True)
        refused[name] = was_refused
    refused["stranger_probe"] = stranger_probe()
    print(f"probes  a stranger's uplink probe refused (a groupmate's measured): {refused['stranger_probe']}")
    with tempfile.TemporaryDirectory(prefix="agora-gaming-") as scratch:
        for name, was_refused in relay_attacks(Path(scratch)).items():
            print(f"relay   {name:<20} refused: {was_refused}", flush=True)
            refused[name] = was_refused
        refused["keyless_worker"] = keyless_worker(Path(scratch))
        print(f"open    keyless worker without --open refused: {refused['keyless_worker']}", flush=True)
        held = half_open(Path(scratch))
    refused["half_open_connections"] = held["honest_answered"] >= 0.99
    print(f"guard   {HELD} half-open connections: {held['honest_answered']:.1%} of honest requests answered")
    summary = {
        "max_cheat_ratio": round(max(cheat_ratios.values()), 3),
        "honest_paid_ratio": round(min(paid_ratios), 3),
        "refused": refused,
        "honest_escrow_release_s": release_s,
        "cheat_ratios": {name: round(ratio, 3) for name, ratio in cheat_ratios.items()},
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    return 0 if all(refused.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
