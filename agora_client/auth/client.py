"""Client side of the auth service: exchange a token for a slot, wait in the join queue, keep the slot.

The token travels only in the body of ``POST /v1/join``; it is held in a ``Secret`` and never put
into an event, a log line, an exception message or a repr. It never goes over plain http:// to a host on the
internet, nor does a snapshot come from one, unless the contributor passed ``--insecure`` (``transport.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from hivemind.utils.crypto import RSAPrivateKey

from agora_client.events import AuthEvent, EventWriter, QueueEvent
from agora_client.network.outage import Outage, send

from .key_proof import sign_join
from .reachability import DialResult
from .secret import Secret
from .transport import TOKEN_IN_CLEAR, WEIGHTS_IN_CLEAR, PlainHttpRefused, connection_failure, refuse_plain_http

log = logging.getLogger(__name__)

_MAX_POLL_FAILURES = 5
_JOIN_RATE_LIMIT_RETRIES = 3  # a join answered 429 is sent again at most this many times, then fails
_DEFAULT_RETRY_AFTER_S = 5.0  # a 429 without a readable Retry-After
_MAX_RETRY_AFTER_S = 60.0  # a hostile or broken server cannot park the client for hours
_MIN_RETRY_AFTER_S = 1.0  # nor make it ask again at once, over and over


class AuthError(Exception):
    """Authorization did not succeed; the message says why and what to do."""


class AuthRejected(AuthError):
    """The service turned the join away (swarm at capacity, identity cap reached, ...)."""


class AuthFailed(AuthError):
    """The join could not be made (invalid token, service unreachable, bad answer, cancelled)."""


class PeerUnreachable(AuthError):
    """The auth service could not connect back to this peer's port; ``dial`` says where from and how it failed.
    ``relay_pass``: what the run's relays ask of this peer's reserve ("" when the run has none)."""

    def __init__(self, dial: DialResult, relay_pass: str = ""):
        super().__init__(f"the swarm could not connect to this worker at {dial.address} ({dial.error})")
        self.dial, self.relay_pass = dial, relay_pass


@dataclass(frozen=True)
class StageAssignment:
    """The stage a joiner will serve, known as soon as it is queued: download its snapshot meanwhile."""

    stage: str
    snapshot_url: str | None


@dataclass(frozen=True)
class Authorization:
    identity: str
    peer_id: str
    stage: str
    slot: int
    seeds: tuple[str, ...]
    snapshot_url: str | None
    ticket: str = field(repr=False)
    expires_at: float
    public_key: str
    swarm_url: str
    queued_s: float = 0.0
    dial: DialResult | None = None  # the service's dial-back before admission; None if it did not check


def authorize(
    swarm_url: str,
    token: str | Secret,
    peer_id: str,
    *,
    events: EventWriter,
    poll_every: float = 5.0,
    queue_log_every: float = 60.0,
    on_assigned: Callable[[StageAssignment], None] | None = None,
    stop: threading.Event | None = None,
    client: httpx.Client | None = None,
    timeout_s: float = 30.0,
    port: int | None = None,
    announce: str | None = None,
    gpu_memory: int | None = None,
    host_memory: int | None = None,
    peer_key: RSAPrivateKey | None = None,
    insecure: bool = False,
    outage: Outage | None = None,
) -> Authorization:
    """Join the swarm at ``swarm_url`` (the auth service); wait in its queue if it paces joins.

    Emits AuthEvent authorizing -> authorized | rejected | failed, and while queued a QueueEvent at once and then every
    ``queue_log_every`` seconds. ``on_assigned`` is called once, as soon as the stage is known (possibly while still
    queued), so the caller can start the snapshot download. ``port`` (or ``announce`` HOST:PORT) is where this peer
    listens: the service dials it back before admission and raises PeerUnreachable (no event: the caller diagnoses and
    retries) if it cannot connect. ``gpu_memory`` (bytes) lets the service assign only a stage that GPU can hold,
    and ``host_memory`` (available RAM, bytes) only one whose host needs in that GPU's layout this machine holds.
    ``peer_key`` (``peer_id``'s) signs each join. Plain http:// outside loopback and the private networks (the
    service, its snapshots) fails unless ``insecure``. With ``outage``, a service down is waited for. Raises
    AuthRejected or AuthFailed (after its event)."""
    secret, base = Secret(token), swarm_url.rstrip("/")
    events.emit(AuthEvent(status="authorizing", peer_id=peer_id, message=f"Authorizing with {base}"))
    _refuse_plain_http_service(base, insecure, events, peer_id)
    with _http_client(client, timeout_s) as http:
        return _JoinAttempt(
            http=http,
            base=base,
            secret=secret,
            peer_id=peer_id,
            peer_key=peer_key,
            events=events,
            where=_listening_fields(port, announce, gpu_memory, host_memory),
            poll_every=poll_every,
            queue_log_every=queue_log_every,
            on_assigned=on_assigned,
            waiter=stop or threading.Event(),
            insecure=insecure,
            outage=outage,
        ).run()


def _refuse_plain_http_service(base: str, insecure: bool, events: EventWriter, peer_id: str) -> None:
    """Plain http:// to an auth service on the internet emits a failure and raises: the token would travel in clear."""
    try:
        refuse_plain_http(base, insecure=insecure, what="the swarm's auth service", why=TOKEN_IN_CLEAR)
    except PlainHttpRefused as error:
        raise _fail(events, peer_id, str(error)) from None


@contextlib.contextmanager
def _http_client(client: httpx.Client | None, timeout_s: float) -> Iterator[httpx.Client]:
    """The caller's client, left open; or a new one, closed on the way out."""
    http = client or httpx.Client(timeout=timeout_s)
    try:
        yield http
    finally:
        if client is None:
            http.close()


def _listening_fields(
    port: int | None, announce: str | None, gpu_memory: int | None, host_memory: int | None
) -> dict[str, Any]:
    """The join's fields saying where this peer listens and what its GPU and host hold, those given."""
    fields = (
        ("port", port),
        ("announce", announce),
        ("gpu_memory_bytes", gpu_memory),
        ("host_memory_bytes", host_memory),
    )
    return {key: value for key, value in fields if value is not None}


@dataclass
class _JoinAttempt:
    """One authorization: join, wait in the queue while the service says so, and read the slot granted."""

    http: httpx.Client
    base: str
    secret: Secret = field(repr=False)
    peer_id: str
    peer_key: RSAPrivateKey | None = field(repr=False)
    events: EventWriter
    where: dict[str, Any]
    poll_every: float
    queue_log_every: float
    on_assigned: Callable[[StageAssignment], None] | None
    waiter: threading.Event
    insecure: bool
    outage: Outage | None = None
    queued_since: float | None = None
    assigned: bool = False  # on_assigned was called
    last_queue_log: float = -float("inf")
    poll_failures: int = 0
    poll_rate_limited: bool = False  # said once per authorization, however often it happens

    def run(self) -> Authorization:
        """The slot granted, its event emitted; calls ``on_assigned`` once the stage is known, if the queue did not."""
        reply = self._send_join()
        dial = reply.get("dial")  # only the join's reply carries it; polls come later
        reply = self._wait_in_queue(reply)
        self._snapshot_url(reply)
        authorization = self._read_authorization(reply, dial)
        if self._stage_unannounced():
            self._announce_stage(StageAssignment(authorization.stage, authorization.snapshot_url))
        _emit_authorized(self.events, self.peer_id, authorization)
        return authorization

    def _send_join(self) -> dict[str, Any]:
        """POST /v1/join, again after each rate limit's Retry-After (a few times).

        A failure emits its event and raises."""
        rate_limits = 0
        while True:
            try:
                return _join(self, self.secret, self.peer_key)
            except _RateLimited as limited:
                rate_limits += 1
                if rate_limits > _JOIN_RATE_LIMIT_RETRIES:
                    raise _fail(
                        self.events,
                        self.peer_id,
                        f"the auth service at {self.base} keeps rate-limiting joins from this address; try again later",
                    ) from None
                log.info("the auth service rate-limited the join; joining again in %g s", limited.wait_s)
                self._pause(limited.wait_s, "authorization cancelled while waiting to join again")

    def _wait_in_queue(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Poll until the reply is no longer "queued"; returns that reply."""
        while reply["status"] == "queued":
            self.queued_since = self.queued_since or time.monotonic()
            if self._stage_unannounced():
                self._announce_stage(StageAssignment(reply["stage"], self._snapshot_url(reply)))
            self._log_queue_place(reply)
            self._sleep_until_next_poll(reply)
            reply = self._poll(reply)
        return reply

    def _snapshot_url(self, reply: dict[str, Any]) -> Any:
        """The snapshot URL the service handed out; plain http:// to the internet fails the join unless ``insecure``."""
        url = reply.get("snapshot_url")
        try:
            if isinstance(url, str):
                refuse_plain_http(url, insecure=self.insecure, what="the snapshot store", why=WEIGHTS_IN_CLEAR)
        except PlainHttpRefused as error:
            raise _fail(self.events, self.peer_id, str(error)) from None
        return url

    def _stage_unannounced(self) -> bool:
        return self.on_assigned is not None and not self.assigned

    def _announce_stage(self, assignment: StageAssignment) -> None:
        """Tell the caller the stage (once), so it can start the snapshot download."""
        assert self.on_assigned is not None
        self.assigned = True
        self.on_assigned(assignment)

    def _log_queue_place(self, reply: dict[str, Any]) -> None:
        """A QueueEvent at once, then every ``queue_log_every`` seconds."""
        if time.monotonic() - self.last_queue_log >= self.queue_log_every:
            self.last_queue_log = time.monotonic()
            self.events.emit(
                QueueEvent(position=int(reply["position"]), estimated_wait_s=reply.get("estimated_wait_s"))
            )

    def _sleep_until_next_poll(self, reply: dict[str, Any]) -> None:
        interval = min(self.poll_every, float(reply.get("poll_every_s") or self.poll_every))
        self._pause(interval, "authorization cancelled while waiting in the join queue")

    def _pause(self, seconds: float, cancelled: str) -> None:
        """Wait ``seconds``; a stop set meanwhile fails the join at once with the message ``cancelled``."""
        if self.waiter.wait(seconds):
            raise _fail(self.events, self.peer_id, cancelled)

    def _poll(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The queue's next answer; a lost place joins again, a failed poll keeps ``reply`` until too many fail."""
        try:
            answer = self._post_poll(reply)
        except _PlaceLost:
            log.info("the join queue place was lost; joining again")
            return self._send_join()
        except _Unreachable as error:
            self.poll_failures += 1
            if self.poll_failures >= _MAX_POLL_FAILURES:
                raise _fail(self.events, self.peer_id, str(error)) from None
            log.warning("polling the join queue failed (%d/%d): %s", self.poll_failures, _MAX_POLL_FAILURES, error)
            return reply
        except _Refused as error:
            raise _answer_error(self.events, self.peer_id, error) from None
        self.poll_failures = 0
        return answer

    def _post_poll(self, reply: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/join/poll; a rate-limited poll keeps the queue place: it waits the Retry-After and polls again."""
        while True:
            try:
                return _post(
                    self.http,
                    f"{self.base}/v1/join/poll",
                    {"queue_id": reply["queue_id"], "peer_id": self.peer_id},
                    self.outage,
                )
            except _RateLimited as limited:
                if not self.poll_rate_limited:
                    log.info(
                        "the auth service rate-limits polling the join queue; keeping the place, polling again "
                        "after each Retry-After (%g s now)",
                        limited.wait_s,
                    )
                    self.poll_rate_limited = True
                self._pause(limited.wait_s, "authorization cancelled while waiting in the join queue")

    def _read_authorization(self, reply: dict[str, Any], dial: Any) -> Authorization:
        waited_s = time.monotonic() - self.queued_since if self.queued_since else 0.0
        try:
            return _authorization(reply, self.base, waited_s, dial)
        except AuthFailed as error:
            raise _fail(self.events, self.peer_id, str(error)) from None


def _emit_authorized(events: EventWriter, peer_id: str, authorization: Authorization) -> None:
    events.emit(
        AuthEvent(
            status="authorized",
            identity=authorization.identity,
            stage=authorization.stage,
            peer_id=peer_id,
            slot=authorization.slot,
            message=f"Authorized as {authorization.identity}: slot {authorization.slot} on stage {authorization.stage}",
        )
    )


def report_active(
    swarm_url: str, ticket: str, *, client: httpx.Client | None = None, outage: Outage | None = None
) -> None:
    """Tell the service the peer is up in the swarm, which lets the next joiner of its stage in; with ``outage``,
    through an outage of the service."""
    _call(swarm_url, "/v1/active", {"ticket": ticket}, client, outage=outage)


def renew_ticket(swarm_url: str, ticket: str, *, client: httpx.Client | None = None) -> tuple[str, float]:
    """Extend the slot before the ticket expires; returns (new ticket, its expiry)."""
    reply = _call(swarm_url, "/v1/renew", {"ticket": ticket}, client)
    return str(reply["ticket"]), float(reply["expires_at"])


def leave(swarm_url: str, ticket: str, *, client: httpx.Client | None = None, timeout_s: float = 30.0) -> bool:
    """Free the slot; True if the service still held it. ``timeout_s`` bounds the call when no client is given."""
    return bool(_call(swarm_url, "/v1/leave", {"ticket": ticket}, client, timeout_s).get("freed"))


def call_service(swarm_url: str, path: str, body: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """POST ``body`` to one of the auth service's endpoints; its JSON answer, or AuthFailed saying why not."""
    return _call(swarm_url, path, body, None, timeout_s)


def swarm_status(swarm_url: str, *, client: httpx.Client | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    http = client or httpx.Client(timeout=timeout_s)
    try:
        response = http.get(f"{swarm_url.rstrip('/')}/v1/status")
        return _decode(response, swarm_url)
    except httpx.HTTPError as error:
        raise AuthFailed(_unreachable_message(swarm_url, error)) from None
    finally:
        if client is None:
            http.close()


# -- internals ------------------------------------------------------------------------------------------


class _Unreachable(Exception):
    pass


class _PlaceLost(Exception):
    pass


class _RateLimited(Exception):
    """HTTP 429: ask again after ``wait_s`` seconds (the Retry-After, bounded)."""

    def __init__(self, wait_s: float):
        super().__init__(f"rate limited; retry after {wait_s:g} s")
        self.wait_s = wait_s


class _Refused(Exception):
    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


def _join(attempt: _JoinAttempt, token: Secret, peer_key: RSAPrivateKey | None) -> dict[str, Any]:
    events, peer_id = attempt.events, attempt.peer_id
    # signed afresh each time: a re-join after a lost queue place may come much later
    proof = sign_join(peer_key, peer_id, token, time.time()) if peer_key is not None else {}
    body = {"token": token.reveal(), "peer_id": peer_id, **attempt.where, **proof}
    try:
        return _post(attempt.http, f"{attempt.base}/v1/join", body, attempt.outage)
    except _Unreachable as error:
        stopped = attempt.waiter.is_set()  # a stop ended the wait for the service to come back
        message = "authorization cancelled while the auth service was unreachable" if stopped else str(error)
        raise _fail(events, peer_id, message) from None
    except (_Refused, _PlaceLost) as error:
        raise _answer_error(events, peer_id, error) from None


def _post(http: httpx.Client, url: str, body: dict[str, Any], outage: Outage | None = None) -> dict[str, Any]:
    try:
        response = send(outage, lambda: http.post(url, json=body))
    except httpx.HTTPError as error:
        raise _Unreachable(_unreachable_message(url, error)) from None
    if response.status_code == 404 and url.endswith("/v1/join/poll"):
        raise _PlaceLost()
    if response.status_code == 429:
        raise _RateLimited(_retry_after_s(response.headers.get("Retry-After")))
    return _decode(response, url)


def _retry_after_s(header: str | None) -> float:
    """The wait a 429's Retry-After asks for (delta-seconds), within the bounds above; the default when absent or
    unreadable (an HTTP-date included: the auth service sends seconds)."""
    try:
        wait_s = float(header) if header is not None else _DEFAULT_RETRY_AFTER_S
    except ValueError:
        wait_s = _DEFAULT_RETRY_AFTER_S
    if math.isnan(wait_s) or wait_s < 0:
        wait_s = _DEFAULT_RETRY_AFTER_S
    return min(_MAX_RETRY_AFTER_S, max(_MIN_RETRY_AFTER_S, wait_s))


def _decode(response: httpx.Response, url: str) -> dict[str, Any]:
    try:
        reply = response.json()
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or "status" not in reply:
        raise _Refused(
            response.status_code,
            f"{url} answered HTTP {response.status_code} without a JSON reply; is it an Agora auth service?",
        )
    if reply["status"] in ("authorized", "queued", "ok"):
        return reply
    if reply["status"] == "unreachable" and isinstance(reply.get("dial"), dict):
        try:
            dial = DialResult.from_json(reply["dial"])
        except (KeyError, TypeError, ValueError):
            raise _Refused(response.status_code, f"{url} answered an unreadable reachability result") from None
        relay_pass = reply.get("relay_pass")
        raise PeerUnreachable(dial, relay_pass if isinstance(relay_pass, str) else "")
    raise _Refused(
        response.status_code, str(reply.get("reason") or reply.get("error") or f"HTTP {response.status_code}")
    )


def _answer_error(events: EventWriter, peer_id: str, error: Exception) -> AuthError:
    status_code = getattr(error, "status_code", None)
    if status_code in (401, 403):  # a refused token is a rejection too: retrying the same token cannot help
        message = f"the swarm did not accept your token: {error}" if status_code == 401 else str(error)
        events.emit(AuthEvent(status="rejected", peer_id=peer_id, message=message))
        return AuthRejected(message)
    return _fail(events, peer_id, f"the auth service refused the join: {error}")


def _fail(events: EventWriter, peer_id: str, message: str) -> AuthFailed:
    events.emit(AuthEvent(status="failed", peer_id=peer_id, message=message))
    return AuthFailed(message)


def _unreachable_message(url: str, error: httpx.HTTPError) -> str:
    return (
        f"could not reach the auth service at {url} ({connection_failure(error)}); check the address and your "
        "network, then try again"
    )


def _authorization(reply: dict[str, Any], base: str, waited_s: float, dial: Any) -> Authorization:
    try:
        return Authorization(
            identity=str(reply["identity"]),
            peer_id=str(reply["peer_id"]),
            stage=str(reply["stage"]),
            slot=int(reply["slot"]),
            seeds=tuple(str(seed) for seed in reply.get("seeds", ())),
            snapshot_url=reply.get("snapshot_url"),
            ticket=str(reply["ticket"]),
            expires_at=float(reply["expires_at"]),
            public_key=str(reply["public_key"]),
            swarm_url=base,
            queued_s=waited_s,
            dial=DialResult.from_json(dial) if isinstance(dial, dict) else None,
        )
    except (KeyError, TypeError, ValueError):
        raise AuthFailed(
            f"{base} answered an authorization without its fields; is it an Agora auth service of this version?"
        ) from None


def _call(
    swarm_url: str,
    path: str,
    body: dict[str, Any],
    client: httpx.Client | None,
    timeout_s: float = 30.0,
    outage: Outage | None = None,
) -> dict[str, Any]:
    http = client or httpx.Client(timeout=timeout_s)
    try:
        return _post(http, f"{swarm_url.rstrip('/')}{path}", body, outage)
    except _Unreachable as error:
        raise AuthFailed(str(error)) from None
    except _RateLimited as limited:
        raise AuthFailed(
            f"the auth service is rate-limiting {path} from this address; retry after {limited.wait_s:g} s"
        ) from None
    except _Refused as error:
        raise AuthFailed(f"the auth service refused {path}: {error}") from None
    finally:
        if client is None:
            http.close()
