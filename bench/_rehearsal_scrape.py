"""Prometheus scrapes during the rehearsal (bench/rehearsal.py): every endpoint of both operator hosts, every
``SCRAPE_EVERY_S`` seconds, from inside the host's namespace (as a Prometheus beside it would), over HTTPS with the
run's CA where the role serves HTTPS. Counts the answers that were 200 with at least one ``agora_`` series."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx

from tests.netns import Host

SCRAPE_EVERY_S = 15.0


class Scraper:
    def __init__(self, endpoints: dict[str, tuple[Host, str]], ca_cert: Path):
        self.endpoints, self.ca_cert = endpoints, ca_cert
        self.ok: Counter[str] = Counter()
        self.tried: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rehearsal-scraper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        return {name: f"{self.ok[name]}/{self.tried[name]}" for name in self.endpoints}

    def _loop(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            for name, (host, url) in self.endpoints.items():
                self.tried[name] += 1
                self.ok[name] += self._scrape(host, url)

    def _scrape(self, host: Host, url: str) -> bool:
        with host.entered():  # this thread only
            try:
                reply = httpx.get(url, verify=str(self.ca_cert), timeout=10)
            except httpx.HTTPError:
                return False
        return reply.status_code == 200 and "agora_" in reply.text
