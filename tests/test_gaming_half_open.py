"""One address holding 1,000 half-open connections (a request line, then a header line now and then, opened again
as soon as the service cuts it) against the auth service in a process whose open-file limit is 1,024, soft and hard
(so raising it at start cannot help), with no kernel firewall: the honest requests of another address are answered."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from tests.half_open import HELD, HONEST_REQUESTS, HalfOpenAttacker, honest_request, start_service, stop_service


def test_gaming_half_open_connections_from_one_address(tmp_path: Path):
    service, port = start_service(tmp_path, 1024, 1024)
    try:
        with HalfOpenAttacker(port) as attacker:
            answered = 0
            for _ in range(HONEST_REQUESTS):
                answered += honest_request(port)
                time.sleep(0.01)  # spread over many of the attacker's reconnections
            reopened = attacker.opened - HELD
    finally:
        log = stop_service(service)
    assert reopened > 0, "the service never cut an attacker's connection"
    assert answered >= 0.99 * HONEST_REQUESTS, f"{HONEST_REQUESTS - answered} honest requests failed"
    assert "Traceback" not in log


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] != resource.RLIM_INFINITY
    and resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 1024,
    reason="the hard open-file limit is 1,024: nothing to raise it to",
)
def test_a_service_raises_its_open_file_limit_and_says_so(tmp_path: Path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    service, _ = start_service(tmp_path, 1024, hard)
    log = stop_service(service)
    assert log.count("raised the open-file limit from 1024 to") == 1, log
