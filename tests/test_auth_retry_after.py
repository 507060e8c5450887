"""The auth client honours 429 Retry-After: a real auth service on 127.0.0.1 with rate limits that hold on loopback."""

from __future__ import annotations

import io
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from agora_client.auth import (
    AdmissionPolicy,
    AuthFailed,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    write_demo_token_file,
)
from agora_client.auth import client as auth_client
from agora_client.auth.client import call_service
from agora_client.events import AuthEvent, EventWriter, parse_event
from agora_client.http_service import RateLimit

pytestmark = pytest.mark.timeout(60)

CLIENT_LOG = "agora_client.auth.client"


@contextmanager
def auth_server(tmp_path: Path, *, pacing_s: float = 0.0, **rates):
    token_file = tmp_path / "tokens.json"
    tokens = {name: write_demo_token_file(token_file, name) for name in ("alice", "bob")}
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=("head",), pacing_s=pacing_s, max_pending_per_stage=100),
        snapshot_url=None,
        poll_every_s=0.05,
    )
    service = AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state")
    with AuthServer(service, **rates) as server:
        yield server, tokens


@contextmanager
def recording_client():
    """An httpx client that notes (path, status) of every answer it gets."""
    answers: list[tuple[str, int]] = []
    with httpx.Client(
        event_hooks={"response": [lambda r: answers.append((r.request.url.path, r.status_code))]}
    ) as http:
        yield http, answers


def join(server, token, peer_id, buffer: io.StringIO, **kwargs):
    return authorize(server.url, token, peer_id, events=EventWriter(buffer), poll_every=0.05, **kwargs)


def auth_statuses(buffer: io.StringIO) -> list[str]:
    return [event.status for event in map(parse_event, buffer.getvalue().splitlines()) if isinstance(event, AuthEvent)]


def codes(answers: list[tuple[str, int]], path: str) -> list[int]:
    return [status for answered, status in answers if answered == path]


def use_up_the_join_rate(server: AuthServer) -> None:
    """One join from this address (a refused token still counts against the rate)."""
    assert httpx.post(f"{server.url}/v1/join", json={"token": "not-a-token", "peer_id": "other"}).status_code == 401


def test_retry_after_is_read_as_seconds_with_a_default_and_bounds():
    assert auth_client._retry_after_s("2") == 2.0
    assert auth_client._retry_after_s("1.5") == 1.5
    for unreadable in (None, "", "soon", "Wed, 21 Oct 2015 07:28:00 GMT", "-3", "nan"):
        assert auth_client._retry_after_s(unreadable) == auth_client._DEFAULT_RETRY_AFTER_S, unreadable
    for huge in ("86400", "1e12", "inf"):
        assert auth_client._retry_after_s(huge) == 60.0, huge
    assert auth_client._retry_after_s("0") == 1.0  # never a tight loop


def test_a_client_polling_faster_than_the_limit_keeps_its_queue_place_and_is_authorized(tmp_path: Path, caplog):
    poll_rate = RateLimit(
        per_minute=60, burst=1, exempt_loopback=False
    )  # Retry-After 1 s; the client polls every 0.05 s
    with (
        auth_server(tmp_path, pacing_s=2.0, poll_rate=poll_rate) as (server, tokens),
        recording_client() as (http, answers),
    ):
        join(server, tokens["alice"], "first", io.StringIO())  # admitted: the stage takes the next one 2 s later
        buffer = io.StringIO()
        with caplog.at_level(logging.INFO, logger=CLIENT_LOG):
            granted = join(server, tokens["bob"], "second", buffer, client=http)
    assert granted.identity == "bob" and granted.queued_s > 1.0
    polls = codes(answers, "/v1/join/poll")
    assert 429 in polls and polls[-1] == 200, polls
    assert codes(answers, "/v1/join") == [200]  # queued once and never joined again: the place was kept
    assert auth_statuses(buffer) == ["authorizing", "authorized"]
    said = [record for record in caplog.records if "rate-limits polling the join queue" in record.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert tokens["bob"] not in caplog.text


def test_a_rate_limited_join_waits_the_retry_after_and_joins_again(tmp_path: Path, caplog):
    join_rate = RateLimit(per_minute=30, burst=1, exempt_loopback=False)  # Retry-After 2 s
    with auth_server(tmp_path, join_rate=join_rate) as (server, tokens), recording_client() as (http, answers):
        use_up_the_join_rate(server)
        buffer = io.StringIO()
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger=CLIENT_LOG):
            granted = join(server, tokens["bob"], "second", buffer, client=http)
        assert time.monotonic() - started >= 1.5
        assert granted.identity == "bob"
        assert codes(answers, "/v1/join") == [429, 200]
        assert auth_statuses(buffer) == ["authorizing", "authorized"]
        assert any("rate-limited the join; joining again in 2 s" in record.getMessage() for record in caplog.records)
        assert tokens["bob"] not in caplog.text
        # Any other call answered 429 fails at once and says when to retry.
        with pytest.raises(AuthFailed, match=r"rate-limiting /v1/join from this address; retry after 2 s"):
            call_service(server.url, "/v1/join", {"token": "not-a-token", "peer_id": "other"})


def test_a_join_rate_limited_beyond_the_retries_fails_with_the_message(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(auth_client, "_MAX_RETRY_AFTER_S", 1.0)  # the service asks for 60 s; the test waits 1 s a time
    join_rate = RateLimit(per_minute=1, burst=1, exempt_loopback=False)
    with auth_server(tmp_path, join_rate=join_rate) as (server, tokens), recording_client() as (http, answers):
        use_up_the_join_rate(server)
        buffer = io.StringIO()
        started = time.monotonic()
        with pytest.raises(AuthFailed, match="keeps rate-limiting joins from this address; try again later"):
            join(server, tokens["bob"], "second", buffer, client=http)
        assert time.monotonic() - started >= 2.5  # waited between the tries
    assert codes(answers, "/v1/join") == [429] * (1 + auth_client._JOIN_RATE_LIMIT_RETRIES)
    assert auth_statuses(buffer) == ["authorizing", "failed"]


def test_stopping_cancels_the_wait_for_a_rate_limited_join_at_once(tmp_path: Path):
    join_rate = RateLimit(per_minute=1, burst=1, exempt_loopback=False)  # Retry-After 60 s
    with auth_server(tmp_path, join_rate=join_rate) as (server, tokens):
        use_up_the_join_rate(server)
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        buffer = io.StringIO()
        started = time.monotonic()
        with pytest.raises(AuthFailed, match="cancelled while waiting to join again"):
            join(server, tokens["bob"], "second", buffer, stop=stop)
        assert time.monotonic() - started < 10
    assert auth_statuses(buffer) == ["authorizing", "failed"]
