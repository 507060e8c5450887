"""A joining runtime rides out the swarm's services being down (network/outage.py): a real auth service and a real
snapshot server stopped mid-join and started again on the same port; a wrong URL at first start still fails at once,
and a stop ends the wait at once."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from agora_client.auth import (
    AdmissionPolicy,
    AuthFailed,
    AuthServer,
    AuthService,
    ServiceSettings,
    TokenFileIdentity,
    authorize,
    report_active,
    write_demo_token_file,
)
from agora_client.auth.run_description import RunDescriptionError, fetch_description, fetch_tokenizer
from agora_client.events import EventWriter, LogEvent, parse_event
from agora_client.network.outage import Outage
from agora_client.snapshots import download_snapshot, load_stage_snapshot, save_stage_snapshot, serve_directory
from tests.test_join_from_url import service

BOUND_S = 60.0  # generous: the machine is shared
FAST = {"first_wait_s": 0.05, "max_wait_s": 0.2}


def network_lines(buffer: io.StringIO) -> list[str]:
    events = [parse_event(line) for line in buffer.getvalue().splitlines()]
    return [event.message for event in events if isinstance(event, LogEvent) and event.tag == "NETWORK"]


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.02)


def closed_port() -> int:
    """A port nothing listens on (one a server just gave back)."""
    with serve_directory(Path(__file__).parent) as server:
        return int(server.url.rsplit(":", 1)[1])


class InThread:
    """``function()`` in a thread; ``result()`` what it returned or raised."""

    def __init__(self, function: Callable[[], object]):
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(function,), daemon=True)
        self.thread.start()

    def _run(self, function: Callable[[], object]) -> None:
        try:
            self.value = function()
        except BaseException as error:
            self.error = error

    def result(self) -> object:
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture
def auth_service(tmp_path: Path):
    token_file = tmp_path / "tokens.json"
    token = write_demo_token_file(token_file, "alice")
    settings = ServiceSettings(
        policy=AdmissionPolicy(stages=("head", "tail"), pacing_s=0.0, max_pending_per_stage=10),
        snapshot_url="http://127.0.0.1:1/snaps",
        seeds=("/ip4/127.0.0.1/tcp/4001/p2p/QmSeed",),
        poll_every_s=0.05,
    )
    return AuthService(settings, TokenFileIdentity(token_file), tmp_path / "state"), token


def test_a_join_waits_for_the_auth_service_to_come_back(auth_service):
    service, token = auth_service
    server = AuthServer(service).start()
    url, port = server.url, int(server.url.rsplit(":", 1)[1])
    server.close()  # the operator's host restarts
    buffer, stop = io.StringIO(), threading.Event()
    events = EventWriter(buffer)
    outage = Outage(f"the swarm's auth service at {url}", events, stop, limit_s=BOUND_S, **FAST)
    joining = InThread(lambda: authorize(url, token, "peerA", events=events, stop=stop, outage=outage))
    wait_for(lambda: any("unreachable since" in line for line in network_lines(buffer)))
    with AuthServer(service, port=port):
        authorization = joining.result()
        report_active(url, authorization.ticket, outage=outage)
    assert authorization.stage in ("head", "tail")
    lines = network_lines(buffer)
    assert len([line for line in lines if "unreachable since" in line]) == 1  # said once, however many tries
    assert any("reachable again" in line for line in lines)


def test_the_tokenizer_is_fetched_once_the_auth_service_is_back(tmp_path: Path):
    with service(tmp_path) as (server, _):
        run = fetch_description(server.url)  # the first start reached the swarm
    url, port = server.url, int(server.url.rsplit(":", 1)[1])
    buffer = io.StringIO()
    outage = Outage(f"the swarm's auth service at {url}", EventWriter(buffer), threading.Event(), **FAST)
    fetching = InThread(lambda: fetch_tokenizer(url, run, outage=outage))
    wait_for(lambda: any("unreachable since" in line for line in network_lines(buffer)))
    with AuthServer(server.service, port=port):
        tokenizer = fetching.result()
    assert tokenizer.sha256 == run.tokenizer.sha256


class BehindAProxy(BaseHTTPRequestHandler):
    """A proxy whose backend is down for the first DOWN_FOR requests: 503, then the service's answer."""

    DOWN_FOR = 3
    seen = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen += 1
        down = self.seen <= self.DOWN_FOR
        body = b"<html>Service Unavailable</html>" if down else json.dumps({"status": "ok"}).encode()
        self.send_response(503 if down else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_proxy_answering_503_is_an_outage_too():
    buffer = io.StringIO()
    outage = Outage("the swarm's auth service", EventWriter(buffer), threading.Event(), limit_s=BOUND_S, **FAST)
    with ThreadingHTTPServer(("127.0.0.1", 0), BehindAProxy) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            report_active(f"http://127.0.0.1:{proxy.server_address[1]}", "ticket", outage=outage)
        finally:
            proxy.shutdown()
    assert BehindAProxy.seen == BehindAProxy.DOWN_FOR + 1
    lines = network_lines(buffer)
    assert len(lines) == 2 and "unreachable since" in lines[0] and "reachable again" in lines[1]


def test_an_outage_longer_than_the_limit_fails_with_the_usual_error():
    buffer = io.StringIO()
    outage = Outage("the swarm's auth service", EventWriter(buffer), threading.Event(), limit_s=0.5, **FAST)
    started = time.monotonic()
    with pytest.raises(AuthFailed, match="could not reach the auth service"):
        report_active(f"http://127.0.0.1:{closed_port()}", "ticket", outage=outage)
    assert 0.5 <= time.monotonic() - started < BOUND_S
    assert len([line for line in network_lines(buffer) if "giving up" in line]) == 1


def test_a_stop_ends_the_wait_at_once():
    buffer, stop = io.StringIO(), threading.Event()
    events = EventWriter(buffer)
    outage = Outage("the swarm's auth service", events, stop)  # the defaults: 10 minutes, 5 s between tries
    url = f"http://127.0.0.1:{closed_port()}"
    joining = InThread(lambda: authorize(url, "hf_token", "peerA", events=events, stop=stop, outage=outage))
    wait_for(lambda: bool(network_lines(buffer)))
    stop.set()  # Ctrl-C
    stopped = time.monotonic()
    with pytest.raises(AuthFailed, match="cancelled"):
        joining.result()
    assert time.monotonic() - stopped < 3.0


def test_a_wrong_url_at_first_start_fails_at_once():
    """The first start has no Outage: a wrong address is the user's typo, not an outage."""
    url = f"http://127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(RunDescriptionError, match="could not read the run description"):
        fetch_description(url)
    with pytest.raises(AuthFailed, match="could not reach the auth service"):
        authorize(url, "hf_token", "peerA", events=EventWriter())
    assert time.monotonic() - started < 10.0


def test_a_download_resumes_after_the_snapshot_server_comes_back(tmp_path: Path):
    module = nn.Linear(256, 512)
    optimizer = torch.optim.AdamW(module.parameters())
    directory = save_stage_snapshot(tmp_path / "store", "body2", module, optimizer, epoch=3, keep=1)
    params = directory / "params.safetensors"
    part = tmp_path / "dest" / "body2" / directory.name / "params.safetensors.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(params.read_bytes()[: params.stat().st_size // 2])  # bytes received before the outage
    buffer, stop = io.StringIO(), threading.Event()
    events = EventWriter(buffer)
    first = serve_directory(tmp_path / "store")
    port, went_down = int(first.url.rsplit(":", 1)[1]), threading.Event()

    def down_before_the_file(request: httpx.Request) -> None:
        if request.url.path.endswith(".safetensors") and not went_down.is_set():
            went_down.set()
            first.close()  # the host goes down between the manifest and the file

    outage = Outage("the swarm's snapshot server", events, stop, limit_s=BOUND_S, **FAST)
    with httpx.Client(event_hooks={"request": [down_before_the_file]}) as client:
        downloading = InThread(
            lambda: download_snapshot(
                f"{first.url}/body2/latest.json", tmp_path / "dest", events=events, client=client, outage=outage
            )
        )
        wait_for(lambda: any("unreachable since" in line for line in network_lines(buffer)))
        with serve_directory(tmp_path / "store", port=port):
            target = downloading.result()
    restored = nn.Linear(256, 512)
    assert load_stage_snapshot(target, restored, None).epoch == 3
    assert all((restored.state_dict()[name] == value).all() for name, value in module.state_dict().items())
    resumed = [parse_event(line) for line in buffer.getvalue().splitlines() if '"started"' in line]
    assert any(getattr(event, "resumed_from", 0) > 0 for event in resumed)  # the .part's bytes were kept
