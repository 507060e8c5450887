"""The public page against the monitor's leaderboard (bench/rehearsal.py): the page as a visitor's browser shows it,
Debian's headless chromium (tests/browser.py) in a home's namespace, over the run's TLS.

The browser trusts exactly the run's server key (``--ignore-certificate-errors-spki-list`` with its SPKI hash), as
a visitor's browser trusts a real certificate. Right after the page has drawn its leaderboard, the monitor's
``/leaderboard`` is read from the same home: the same names in the same order, each score within ``SCORE_SLACK``
(the page shows 3 decimals, and presence accrues between the two reads).
"""

from __future__ import annotations

import base64
import hashlib
import time
from pathlib import Path
from typing import Callable

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.browser import browser_missing, start_chromium
from tests.netns import Host

PAGE_WAIT_S = 60.0
SCORE_SLACK = 0.01
_ROWS = """return [...document.querySelectorAll('#leaderboard tbody tr')].map(row =>
    [row.querySelector('td.name').textContent, parseFloat(row.cells[2].textContent)])"""


def spki_sha256(cert_pem: Path) -> str:
    """The base64 sha256 of a certificate's public key, as chromium's SPKI list takes it."""
    key = x509.load_pem_x509_certificate(cert_pem.read_bytes()).public_key()
    spki = key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def page_card(visitor: Host, monitor_url: str, server_cert: Path, leaderboard: Callable[[], list[dict] | None]) -> dict:
    """The page's leaderboard against ``leaderboard()``, the monitor's rows read from ``visitor`` right after."""
    if reason := browser_missing():
        return {"same": None, "skipped": reason}
    from selenium.common.exceptions import WebDriverException

    with visitor.entered():  # chromedriver, chromium and every call to them live in the visitor's namespace
        try:
            driver = start_chromium(extra_args=(f"--ignore-certificate-errors-spki-list={spki_sha256(server_cert)}",))
        except WebDriverException as error:  # the scorecard says so; the run's figures stand
            return {"same": None, "error": f"the browser did not start: {error.msg}"}
        try:
            driver.get(f"{monitor_url}/")
            shown, deadline = [], time.monotonic() + PAGE_WAIT_S
            while not shown and time.monotonic() < deadline:
                shown = driver.execute_script(_ROWS)
                time.sleep(0.5)
            rows = leaderboard()
        except WebDriverException as error:
            return {"same": False, "error": f"the page did not load: {error.msg}"}
        finally:
            driver.quit()
    if not shown or rows is None:
        return {"same": False, "page_rows": len(shown), "monitor_answered": rows is not None}
    served = [(str(row["username"]), float(row["score"])) for row in rows]
    names_match = [name for name, _ in shown] == [name for name, _ in served]
    scores_match = all(abs(a - b) <= SCORE_SLACK for (_, a), (_, b) in zip(shown, served, strict=False))
    return {"same": names_match and scores_match, "page": shown, "monitor": served}
