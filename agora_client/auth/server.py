"""The auth service over HTTP: exchanges a contributor token for a slot, a stage and a signed ticket.

JSON API (every answer is a JSON object with ``status``):
  GET  /v1/run                                -> the run description (run_description.py); 503 if none is set
  GET  /v1/tokenizer                          -> the run's tokenizer.json, whose sha256 the description gives;
                                                 503 if none
  POST /v1/join    {token, peer_id, port, announce?, gpu_memory_bytes?, peer_key?, signed_at?, key_proof?}
                                              -> 200 authorized | 200 queued | 403 rejected | 409 unreachable
                                                 | 400 | 401 | 503
  POST /v1/join/poll {queue_id, peer_id}      -> as /v1/join; 404 if the queue place is gone
  POST /v1/active  {ticket}                   -> 200 ok: the peer is up in the swarm (ends join pacing for it)
  POST /v1/renew   {ticket}                   -> 200 {ticket, expires_at}; 404 if the slot is gone
  POST /v1/leave   {ticket}                   -> 200 {freed: bool}
  POST /v1/trainer/ticket {credential, peer_id} -> 200 {ticket, expires_at}: a trainer ticket for a live trainer
                                              credential (trainer_credentials.py); 403 unknown or revoked
  GET  /v1/status                             -> occupancy per stage, capacity, queue length, public key, seeds,
                                                 and the peer ids holding a slot per stage (the monitor's presence);
                                                 the target workers per stage and the stage a joiner gets next
  POST /v1/probe/upload (any bytes, < 16 MiB)  -> 200 {received, timed_bytes, seconds}: the body's arrival timed
                                               and dropped by the front (the contributor's uplink preflight)
  GET  /metrics                               -> Prometheus text: joins by outcome, queues, slots (operator_metrics.py)
Each client address may POST /v1/join and /v1/join/poll only so often (429 with Retry-After beyond that);
a body over MAX_BODY_BYTES gets 413 (``AuthServer``, on the guarded front of ``agora_client.http_service``).

The token is wrapped in ``Secret`` as soon as it is parsed; the service keeps only its keyed hash.
Slots, queue places and peer bindings live in ``auth_state.sqlite3`` (state_store.py), committed per decision,
so a restarted service carries on where it stopped. A peer id is bound to the identity that first joined with it; with
``dial_back`` on, a join is admitted only after the service connected to the joiner's port
(``port`` at the address the request came from, or ``announce`` HOST:PORT when that host is it, or a port
one of the run's relays holds for the joiner: then the joiner's libp2p host must answer through it);
with ``key_proof`` on, only after the join proved it holds the key of its peer id (``key_proof.py``). A 409 answer
carries a ``relay_pass`` for the joiner's peer id when the run lists relays: what they ask of a reserve
(``relay_pass.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable

from agora_client.data.tokenizer import sha256_of
from agora_client.http_service import (
    PLAIN_HTTP,
    Exposure,
    HttpService,
    RateLimit,
    Reply,
    Request,
    ServiceLimits,
    json_reply,
)
from agora_client.operator_metrics import METRICS_PATH, http_front_collector, metrics_reply, new_registry

from .admission import AdmissionPolicy, Admitted, Decision, Queued, Rejected, UnknownQueueEntry
from .bindings import PeerBindings
from .identity import IdentitySource, IdentityUnavailable, InvalidToken
from .key_proof import KeyProofError, check_join_proof
from .operator_metrics import auth_collector
from .reachability import AnnounceError, DialResult, dial_back, parse_announce
from .relay_pass import issue_relay_pass
from .run_description import RunDescription
from .secret import Secret, token_digest
from .state_store import STATE_DB, AuthStateStore, open_book
from .tickets import (
    TRAINER,
    TRAINER_TICKET_TTL_S,
    InvalidTicket,
    TicketClaims,
    issue_ticket,
    load_or_create_signing_key,
    public_key_text,
    verify_ticket,
)
from .trainer_credentials import CredentialRefused, TrainerCredentials
from .uplink_probe import UPLOAD_PROBE_PATH

log = logging.getLogger(__name__)

PEER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_BODY_BYTES = 64 * 1024
MAX_TOKEN_CHARS = 1024


@dataclass(frozen=True)
class ServiceSettings:
    policy: AdmissionPolicy
    snapshot_url: str | None = None
    """Base URL of the snapshot store (``<base>/<stage>/latest.json``), or a template holding ``{stage}``."""
    seeds: tuple[str, ...] = ()
    poll_every_s: float = 5.0
    identity_cache_s: float = 300.0
    snapshot_links: Callable[[str], str | None] | None = None
    """An object store's presigned snapshot URL for a stage (``S3Store.joiner_url``); wins over snapshot_url."""
    run: RunDescription | None = None
    dial_back: bool = False
    """Connect back to every joiner's announced port before admitting it (the CLI turns this on)."""
    dial_timeout_s: float = 5.0
    key_proof: bool = False
    """Admit only joins signed by the key of the peer id they name (the CLI turns this on)."""
    tokenizer_json: bytes | None = field(default=None, repr=False)
    """The run's tokenizer file (``RunTokenizer.content``), served to joiners.

    It must hash to ``run.tokenizer.sha256``."""

    def snapshot_url_for(self, stage: str) -> str | None:
        if self.snapshot_links is not None:
            return self.snapshot_links(stage)
        if not self.snapshot_url:
            return None
        if "{stage}" in self.snapshot_url:
            return self.snapshot_url.replace("{stage}", stage)
        return f"{self.snapshot_url.rstrip('/')}/{stage}/latest.json"


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class AuthService:
    """The service's state and logic; ``AuthServer`` puts it on HTTP.

    ``state_dir`` holds the signing key, the secret that salts token hashes, the state database (all mode 0600)
    and ``joins.jsonl``, an audit line per join decision.
    """

    def __init__(self, settings: ServiceSettings, identities: IdentitySource, state_dir: Path):
        _check_tokenizer_matches(settings)
        self.settings = settings
        self.identities = identities
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.key = load_or_create_signing_key(self.state_dir / "signing_key.pem")
        self.public_key = public_key_text(self.key)
        self._hash_key = _load_or_create_secret(self.state_dir / "token_hash.key")
        self.store = AuthStateStore(self.state_dir / STATE_DB)
        self.book = open_book(self.store, settings.policy, time.time())
        self.bindings = PeerBindings(self.store, legacy_file=self.state_dir / "peer_bindings.json")
        self.trainer_credentials = TrainerCredentials(self.state_dir)
        self._identity_cache: dict[str, tuple[str, float]] = {}
        self._audit_lock = threading.Lock()
        self._audit_counts: Counter[str] = Counter()  # by event, for the operator's metrics

    # -- endpoints -----------------------------------------------------------------------------------

    def run_description(self) -> dict[str, Any]:
        if self.settings.run is None:
            raise RequestError(
                HTTPStatus.SERVICE_UNAVAILABLE, "this auth service was started without a run description"
            )
        return self.settings.run.to_json()

    def tokenizer_json(self) -> bytes:
        if self.settings.tokenizer_json is None:
            raise RequestError(
                HTTPStatus.SERVICE_UNAVAILABLE, "this auth service was started without the run's tokenizer"
            )
        return self.settings.tokenizer_json

    def join(self, body: dict[str, Any], source: str = "127.0.0.1") -> tuple[HTTPStatus, dict[str, Any]]:
        token = _field(body, "token", str)
        peer_id = _peer_id(body)
        target = self._dial_target(body, source) if self.settings.dial_back else None
        secret = _token_secret(token)
        del token, body["token"]  # from here on only the Secret exists
        digest = token_digest(self._hash_key, secret)
        identity = self._identity(secret, digest, peer_id)
        refusal = self._key_refusal(body, peer_id, secret, digest, identity)
        if refusal is not None:
            return refusal
        dial = None
        if target is not None:
            host, port, relayed = target
            dial = dial_back(host, port, timeout_s=self.settings.dial_timeout_s, through_relay=relayed)
            if not dial.reachable:
                return self._unreachable(dial, digest, identity, peer_id)
        stages = self._stages_that_fit(body.get("gpu_memory_bytes"), body.get("host_memory_bytes"))
        if stages == ():
            self._audit("gpu_too_small", token_hash=digest[:16], identity=identity, peer_id=peer_id)
            reason = self._too_small(body.get("gpu_memory_bytes"), body.get("host_memory_bytes"))
            return HTTPStatus.FORBIDDEN, {"status": "rejected", "reason": reason}
        now = time.time()
        status, payload = self._answer(self.book.join(identity, peer_id, now, stages), now, digest)
        if dial is not None and payload["status"] != "rejected":
            payload["dial"] = dial.to_json()  # the joiner shows where it was reached from
        return status, payload

    def _identity(self, secret: Secret, digest: str, peer_id: str) -> str:
        """The identity the token belongs to; 401 for a token that is not valid, 503 while it cannot be checked."""
        try:
            return self._resolve(secret, digest)
        except InvalidToken as error:
            self._audit("invalid_token", token_hash=digest[:16], peer_id=peer_id)
            raise RequestError(HTTPStatus.UNAUTHORIZED, str(error)) from None
        except IdentityUnavailable as error:
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, str(error)) from None

    def _key_refusal(
        self, body: dict[str, Any], peer_id: str, secret: Secret, digest: str, identity: str
    ) -> tuple[HTTPStatus, dict[str, Any]] | None:
        """The 403 answer when the join does not prove its peer key (if required) or the key is another account's."""
        if self.settings.key_proof:
            try:
                check_join_proof(body, peer_id, secret, time.time())
            except KeyProofError as error:
                self._audit("bad_key_proof", token_hash=digest[:16], identity=identity, peer_id=peer_id)
                return HTTPStatus.FORBIDDEN, {"status": "rejected", "reason": str(error)}
        owner = self.bindings.claim(peer_id, identity)
        if owner != identity:
            reason = (
                f"the key of peer id {peer_id} belongs to another Hugging Face account, not to {identity}; "
                "a key stays with the account that first joined with it: use your own config dir (--config-dir), "
                "or delete the copied key file so that a new key is made"
            )
            self._audit("key_of_other_identity", token_hash=digest[:16], identity=identity, peer_id=peer_id)
            return HTTPStatus.FORBIDDEN, {"status": "rejected", "reason": reason}
        return None

    def _unreachable(
        self, dial: DialResult, digest: str, identity: str, peer_id: str
    ) -> tuple[HTTPStatus, dict[str, Any]]:
        """The 409 answer to a joiner the dial-back could not reach, logged and audited."""
        log.info("peer %s of %s is not reachable at %s (%s)", peer_id, identity, dial.address, dial.error)
        self._audit(
            "unreachable",
            token_hash=digest[:16],
            identity=identity,
            peer_id=peer_id,
            address=dial.address,
            error=dial.error,
        )
        relays = self.settings.run.relays if self.settings.run is not None else ()
        # what the run's relays ask of a reserve: the joiner may serve through one and join again (relay_pass.py)
        relay_pass = {"relay_pass": issue_relay_pass(self.key, identity=identity, peer_id=peer_id)} if relays else {}
        return HTTPStatus.CONFLICT, {
            "status": "unreachable",
            "dial": dial.to_json(),
            "reason": f"could not connect to {dial.address} ({dial.error})",
            **relay_pass,
        }

    def _stages_that_fit(self, memory: Any, host_memory: Any = None) -> tuple[str, ...] | None:
        """The stages a GPU of ``memory`` bytes holds at the run's microbatch, in the layout that card takes them
        in, whose host needs in that layout fit ``host_memory`` bytes of available RAM when it is given (None: any
        stage, for CPU joiners)."""
        if memory is None or self.settings.run is None:
            return None
        for value, name in ((memory, "gpu_memory_bytes"), (host_memory, "host_memory_bytes")):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise RequestError(HTTPStatus.BAD_REQUEST, f"{name} must be a positive whole number of bytes")
        from agora_client.model.memory import holds_stage  # imports torch: only joiners that name a GPU need it

        run = self.settings.run.config
        return tuple(stage for stage in self.book.policy.stages if holds_stage(run, stage, memory, host_memory))

    def _too_small(self, memory: int, host_memory: int | None) -> str:
        from agora_client.model.memory import CUDA_RESERVED_BYTES, choose_layout, gib, layouts_for, plan_stage

        run = self.settings.run.config
        layouts = {stage: choose_layout(run, stage, memory) for stage in self.book.policy.stages}
        held = {stage: layout for stage, layout in layouts.items() if layout is not None}
        if held:  # the GPU holds some stage: the host is what is short
            needs = {stage: plan_stage(run, stage, layout=layout).host_need(True) for stage, layout in held.items()}
            stage = min(needs, key=needs.get)
            return (
                f"this machine's {gib(host_memory)} of available RAM holds none of the stages its GPU can take: the "
                f"smallest need, {stage}'s, is {gib(needs[stage])}; close other programs or join from a machine with "
                "more RAM"
            )
        last = layouts_for(run)[-1]  # the layout that holds the most on a GPU
        plans = [plan_stage(run, stage, layout=last) for stage in self.book.policy.stages]
        smallest = min(plans, key=lambda plan: plan.gpu_peak)
        return (
            f"a GPU with {gib(memory)} holds none of this swarm's stages: the smallest, {smallest.stage}, needs "
            f"{gib(smallest.gpu_peak + CUDA_RESERVED_BYTES)} at {run.optim.microbatch_size} sequence(s) per pass "
            f"(its planned peak in the {last} layout, plus {gib(CUDA_RESERVED_BYTES)} for CUDA itself); "
            "join with a GPU with more memory"
        )

    def _dial_target(self, body: dict[str, Any], source: str) -> tuple[str, int, bool]:
        """(host, port, through a relay): the joiner's own address, or a port one of the run's relays holds for it."""
        announce = body.get("announce")
        if announce is None:
            port = body.get("port")
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise RequestError(
                    HTTPStatus.BAD_REQUEST, "the join names no port to dial back: send the port your worker listens on"
                )
            return source, port, False
        if not isinstance(announce, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "announce must be HOST:PORT text")
        try:
            host, port = parse_announce(announce)
        except AnnounceError as error:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(error)) from None
        if host in self._relay_hosts():
            return host, port, True
        if source not in _addresses_of(host):
            raise RequestError(
                HTTPStatus.BAD_REQUEST,
                f"the announced host {host} is not the address your join came from ({source}); the auth service dials "
                f"back only that address: announce {source}:{port}, or join from the machine at {host}",
            )
        return source, port, False

    def _relay_hosts(self) -> set[str]:
        relays = self.settings.run.relays if self.settings.run is not None else ()
        return {parse_announce(relay)[0] for relay in relays}

    def poll(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        queue_id = _field(body, "queue_id", str)
        peer_id = _peer_id(body)
        now = time.time()
        try:
            decision = self.book.poll(queue_id, peer_id, now)
        except UnknownQueueEntry:
            raise RequestError(
                HTTPStatus.NOT_FOUND,
                "this place in the join queue is gone (not polled in time, or already admitted); join again",
            ) from None
        return self._answer(decision, now, None)

    def active(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        claims = self._claims(body)
        if not self.book.mark_active(claims.stage, claims.slot, claims.peer_id, time.time()):
            raise RequestError(HTTPStatus.NOT_FOUND, "this slot is no longer held (it expired or was left); join again")
        log.info("peer %s of %s is active on stage %s", claims.peer_id, claims.identity, claims.stage)
        return HTTPStatus.OK, {"status": "ok"}

    def renew(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        claims = self._claims(body)
        now = time.time()
        slot = self.book.renew(claims.stage, claims.slot, claims.peer_id, now)
        if slot is None:
            raise RequestError(HTTPStatus.NOT_FOUND, "this slot is no longer held (it expired or was left); join again")
        ticket = self._ticket(slot.identity, slot.peer_id, slot.stage, slot.index, now)
        return HTTPStatus.OK, {"status": "ok", "ticket": ticket, "expires_at": slot.expires_at}

    def leave(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        ticket = _field(body, "ticket", str)
        try:
            # An expired ticket may still leave: its signature proves who sent it.
            claims = verify_ticket(self.key.public_key(), ticket, now=0.0)
        except InvalidTicket as error:
            raise RequestError(HTTPStatus.UNAUTHORIZED, str(error)) from None
        freed = self.book.leave(claims.stage, claims.slot, claims.peer_id, time.time())
        if freed:
            log.info("peer %s of %s left stage %s slot %d", claims.peer_id, claims.identity, claims.stage, claims.slot)
        return HTTPStatus.OK, {"status": "ok", "freed": freed}

    def trainer_ticket(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        """A trainer ticket for ``peer_id`` in exchange for a live trainer credential (held by the operator's
        trainers on other hosts, which then need no signing key)."""
        credential, peer_id = Secret(_field(body, "credential", str)), _peer_id(body)
        del body["credential"]
        try:
            name = self.trainer_credentials.holder(credential)
        except CredentialRefused as error:
            self._audit("trainer_refused", peer_id=peer_id)
            raise RequestError(HTTPStatus.FORBIDDEN, str(error)) from None
        now = time.time()
        ticket = issue_ticket(
            self.key,
            identity=f"trainer:{name}",
            peer_id=peer_id,
            stage=TRAINER,
            slot=0,
            ttl_s=TRAINER_TICKET_TTL_S,
            now=now,
            role=TRAINER,
        )
        self._audit("trainer_ticket", credential=name, peer_id=peer_id)
        return HTTPStatus.OK, {"status": "ok", "ticket": ticket, "expires_at": now + TRAINER_TICKET_TTL_S}

    def status(self) -> dict[str, Any]:
        now = time.time()
        stages = self.book.occupancy(now)
        return {
            "status": "ok",
            "stages": stages,
            "capacity": sum(stage["capacity"] for stage in stages.values()),
            "occupied": sum(stage["active"] + stage["pending"] for stage in stages.values()),
            "queue_length": sum(stage["queued"] for stage in stages.values()),
            "public_key": self.public_key,
            "seeds": list(self.settings.seeds),
            "holders": self._slot_holders(now),
            "demand": self.book.policy.stage_demand.to_json(),  # target workers per stage (stage_demand.py)
            "next_stage": self.book.next_stage(now),
        }

    def _slot_holders(self, now: float) -> dict[str, list[str]]:
        """Peer ids holding a live slot, per stage: a peer earns presence only while it holds one (monitor/points.py).
        Peer ids are public in the stages' rosters already."""
        holders: dict[str, list[str]] = {stage: [] for stage in self.settings.policy.stages}
        for slot in self.store.load_book().slots:
            if slot.expires_at > now and slot.stage in holders:
                holders[slot.stage].append(slot.peer_id)
        return {stage: sorted(peers) for stage, peers in holders.items()}

    # -- helpers -------------------------------------------------------------------------------------

    def _answer(self, decision: Decision, now: float, digest: str | None) -> tuple[HTTPStatus, dict[str, Any]]:
        if isinstance(decision, Rejected):
            log.info("join rejected: %s", decision.reason)
            self._audit("rejected", token_hash=(digest or "")[:16], reason=decision.reason)
            return HTTPStatus.FORBIDDEN, {"status": "rejected", "reason": decision.reason}
        if isinstance(decision, Queued):
            return HTTPStatus.OK, self._queued(decision, digest)
        return HTTPStatus.OK, self._authorized(decision, now, digest)

    def _queued(self, decision: Queued, digest: str | None) -> dict[str, Any]:
        """The answer to a queued joiner: its place, the wait, and its stage's snapshot to fetch meanwhile."""
        entry = decision.entry
        if digest is not None:  # a join, not a poll
            log.info(
                "peer %s of %s queued for stage %s at position %d",
                entry.peer_id,
                entry.identity,
                entry.stage,
                decision.position,
            )
            self._audit(
                "queued",
                token_hash=digest[:16],
                identity=entry.identity,
                peer_id=entry.peer_id,
                stage=entry.stage,
                position=decision.position,
            )
        return {
            "status": "queued",
            "queue_id": entry.queue_id,
            "position": decision.position,
            "estimated_wait_s": decision.estimated_wait_s,
            "stage": entry.stage,
            "snapshot_url": self.settings.snapshot_url_for(entry.stage),
            "poll_every_s": self.settings.poll_every_s,
        }

    def _authorized(self, decision: Admitted, now: float, digest: str | None) -> dict[str, Any]:
        """The answer to an admitted joiner: its slot, stage, seeds, snapshot and ticket."""
        slot = decision.slot
        log.info("admitted peer %s of %s to stage %s slot %d", slot.peer_id, slot.identity, slot.stage, slot.index)
        self._audit(
            "authorized",
            token_hash=(digest or "")[:16],
            identity=slot.identity,
            peer_id=slot.peer_id,
            stage=slot.stage,
            slot=slot.index,
            waited_s=round(decision.waited_s, 1),
        )
        return {
            "status": "authorized",
            "identity": slot.identity,
            "peer_id": slot.peer_id,
            "stage": slot.stage,
            "slot": slot.index,
            "seeds": list(self.settings.seeds),
            "snapshot_url": self.settings.snapshot_url_for(slot.stage),
            "ticket": self._ticket(slot.identity, slot.peer_id, slot.stage, slot.index, now),
            "expires_at": slot.expires_at,
            "public_key": self.public_key,
        }

    def _ticket(self, identity: str, peer_id: str, stage: str, slot: int, now: float) -> str:
        return issue_ticket(
            self.key,
            identity=identity,
            peer_id=peer_id,
            stage=stage,
            slot=slot,
            ttl_s=self.settings.policy.ticket_ttl_s,
            now=now,
        )

    def _claims(self, body: dict[str, Any]) -> TicketClaims:
        try:
            return verify_ticket(self.key.public_key(), _field(body, "ticket", str))
        except InvalidTicket as error:
            raise RequestError(HTTPStatus.UNAUTHORIZED, str(error)) from None

    def _resolve(self, token: Secret, digest: str) -> str:
        """Identity of a token, remembered by its keyed hash for a while (whoami is rate-limited)."""
        cached = self._identity_cache.get(digest)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        identity = self.identities.resolve(token)
        if len(self._identity_cache) > 10_000:
            now = time.monotonic()
            self._identity_cache = {key: item for key, item in self._identity_cache.items() if item[1] > now}
        self._identity_cache[digest] = (identity, time.monotonic() + self.settings.identity_cache_s)
        return identity

    def audit_totals(self) -> dict[str, int]:
        """The audit events of this process so far, by event (the operator's metrics count joins by them)."""
        with self._audit_lock:
            return dict(self._audit_counts)

    def _audit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "event": event, **fields}, sort_keys=True)
        with self._audit_lock, open(self.state_dir / "joins.jsonl", "a", encoding="utf-8") as audit:
            audit.write(line + "\n")
            self._audit_counts[event] += 1


AUTH_LIMITS = ServiceLimits(max_body_bytes=MAX_BODY_BYTES)
JOIN_RATE = RateLimit(per_minute=10, burst=5)
"""Joins per client address: a client joins once and retries a failed dial-back after a while."""
POLL_RATE = RateLimit(per_minute=120, burst=30)
"""Queue polls per client address: one queued client polls every ``poll_every_s`` (5 s); a shared NAT holds several."""
UPLOAD_PROBE_RATE = RateLimit(per_minute=6, burst=3)
"""Upload probes per client address: a contributor probes once per start (its preflight)."""


class AuthServer:
    """``AuthService`` on the guarded HTTP front (``agora_client.http_service``); ``url`` once constructed.

    Every client address gets ``join_rate`` on POST /v1/join and ``poll_rate`` on POST /v1/join/poll (429 with
    Retry-After beyond them), and ``UPLOAD_PROBE_RATE`` on the upload probe; ``limits`` sets the timeouts,
    connection caps and body size limit. ``exposure``: TLS, and the reverse proxies whose X-Forwarded-For names
    the client (rate limits, the dial-back target and the audit log take that address).
    """

    def __init__(
        self,
        service: AuthService,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServiceLimits = AUTH_LIMITS,
        join_rate: RateLimit = JOIN_RATE,
        poll_rate: RateLimit = POLL_RATE,
        exposure: Exposure = PLAIN_HTTP,
    ):
        self.service = service
        self._http = HttpService(
            self._answer,
            host,
            port,
            name="auth-http",
            limits=limits,
            rate_limits={
                ("POST", "/v1/join"): join_rate,
                ("POST", "/v1/join/poll"): poll_rate,
                ("POST", UPLOAD_PROBE_PATH): UPLOAD_PROBE_RATE,
            },
            quick_routes=[("GET", "/v1/status"), ("GET", "/v1/run"), ("GET", "/v1/tokenizer"), ("GET", METRICS_PATH)],
            upload_probes=[("POST", UPLOAD_PROBE_PATH)],
            exposure=exposure,
        )
        self._metrics = new_registry(
            auth_collector(service.audit_totals, service.book), http_front_collector(self._http)
        )

    @property
    def url(self) -> str:
        return self._http.url

    def start(self) -> "AuthServer":
        self._http.start()
        return self

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "AuthServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _answer(self, request: Request) -> Reply:
        """Runs in a handler thread: the service's calls may block (dial-back, identity lookups)."""
        try:
            if request.method == "GET":
                reply = self._get(request.path)
            elif request.method == "POST":
                reply = self._post(request)
            else:
                raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint: {request.method} {request.path}")
        except RequestError as error:
            reply = json_reply(error.status, {"status": "error", "error": str(error)})
        except Exception:  # the service keeps running; the client gets one line, the log the traceback
            log.exception("internal error answering %s %s", request.method, request.path)
            reply = json_reply(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                {"status": "error", "error": "internal error in the auth service; try again later"},
            )
        reply.headers["Cache-Control"] = "no-store"
        return reply

    def _get(self, path: str) -> Reply:
        if path == "/v1/status":
            return json_reply(HTTPStatus.OK, self.service.status())
        if path == "/v1/run":
            return json_reply(HTTPStatus.OK, self.service.run_description())
        if path == "/v1/tokenizer":  # the file as it is: its sha256 is checked
            return Reply(HTTPStatus.OK, self.service.tokenizer_json(), {"Content-Type": "application/json"})
        if path == METRICS_PATH:
            return metrics_reply(self._metrics)
        raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {path}")

    def _post(self, request: Request) -> Reply:
        method = _POSTS.get(request.path)
        if method is None:
            raise RequestError(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {request.path}")
        if (
            method == "join"
        ):  # the dial-back goes to the address the join came from (behind a trusted proxy: its client)
            status, payload = self.service.join(_json_body(request.body), source=request.source)
        else:
            status, payload = getattr(self.service, method)(_json_body(request.body))
        return json_reply(status, payload)


_POSTS = {
    "/v1/join": "join",
    "/v1/join/poll": "poll",
    "/v1/active": "active",
    "/v1/renew": "renew",
    "/v1/leave": "leave",
    "/v1/trainer/ticket": "trainer_ticket",
}


def _json_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object (the HTTP front already refused bodies over MAX_BODY_BYTES)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the request body is not JSON; send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if not isinstance(value, kind):
        raise RequestError(HTTPStatus.BAD_REQUEST, f"the request needs '{name}' ({kind.__name__})")
    return value


def _token_secret(token: str) -> Secret:
    """The join's token, held as a Secret; 400 if it is empty, too long or holds spaces."""
    if not token.strip() or len(token) > MAX_TOKEN_CHARS or any(ch.isspace() for ch in token):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, "the token is empty, too long or holds spaces; paste the token again"
        )
    return Secret(token)


def _peer_id(body: dict[str, Any]) -> str:
    peer_id = _field(body, "peer_id", str)
    if not PEER_ID.match(peer_id):
        raise RequestError(
            HTTPStatus.BAD_REQUEST, "peer_id must be 1-128 letters, digits or . _ : - (a libp2p peer id)"
        )
    return peer_id


def _check_tokenizer_matches(settings: ServiceSettings) -> None:
    """Refuse to serve a tokenizer file other than the one the run description pins."""
    if settings.run is None or settings.tokenizer_json is None:
        return
    if sha256_of(settings.tokenizer_json) != settings.run.tokenizer.sha256:
        raise ValueError(
            f"the tokenizer file to serve has sha256 {sha256_of(settings.tokenizer_json)[:16]}..., but the "
            f"run description says {settings.run.tokenizer.sha256[:16]}...: describe the run with the tokenizer "
            "it serves"
        )


def _load_or_create_secret(path: Path) -> bytes:
    if path.exists():
        return bytes.fromhex(path.read_text().strip())
    secret = secrets.token_bytes(32)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret.hex())
    return secret


def _addresses_of(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()
