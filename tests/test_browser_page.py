"""The swarm's public page in a real headless browser (Debian's chromium through Selenium) against a real monitor HTTP
server on 127.0.0.1 holding a recorded swarm (tests/recorded_swarm.py): what it shows, that a hostile user name stays
text, that it asks no other host for anything and logs no error, that it refreshes itself, and how it looks on a desktop
and on a phone (screenshots under the test's temporary folder)."""

from __future__ import annotations

import time
from urllib.parse import unquote

import pytest

from agora_client.monitor.http_api import LeaderboardServer
from agora_client.monitor.points import Observation
from tests.browser import (
    browser_missing,
    console_errors,
    emulate_desktop,
    emulate_phone,
    full_page_screenshot,
    requested_urls,
    start_chromium,
)
from tests.recorded_swarm import HOSTILE_NAME, NAMED, STAGES, TICKET, WITHHELD_REASON, record_swarm

pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")
WAIT_S = 15.0


@pytest.fixture(scope="module")
def monitor(tmp_path_factory):
    store, run = record_swarm(tmp_path_factory.mktemp("monitor") / "points.sqlite", now=time.time())
    server = LeaderboardServer(store, run=run).start()
    yield server
    server.stop()
    store.close()


@pytest.fixture(scope="module")
def browser():
    driver = start_chromium()
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, monitor):
    """The browser, its logs emptied; after the test, nothing it loaded logged an error or went to another host."""
    emulate_desktop(browser)
    console_errors(browser), requested_urls(browser)
    yield browser
    assert console_errors(browser) == []
    urls = requested_urls(browser)
    assert urls, "the performance log recorded no request: the network check would prove nothing"
    assert [url for url in urls if not url.startswith(f"{monitor.url}/")] == []


def wait_for(driver, script: str, what: str):
    """Polls ``script`` (a JS expression) in the page until it is truthy; its value."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {script};")
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(
        f"{what} within {WAIT_S:g} s; the page says: {driver.find_element('tag name', 'body').text[:500]}"
    )


def leaderboard_names(driver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#leaderboard tbody td.name a')].map(a => a.textContent)"
    )


def no_dialog(driver) -> bool:
    from selenium.webdriver.support.expected_conditions import alert_is_present

    return not alert_is_present()(driver)


def test_browser_swarm_page_shows_run_stages_chart_and_leaderboard(page, monitor):
    page.get(f"{monitor.url}/")
    wait_for(page, "document.querySelectorAll('#leaderboard tbody tr').length", "no leaderboard row appeared")
    assert sorted(leaderboard_names(page)) == sorted(NAMED)
    assert page.find_element("id", "run-name").text == "Agora: tiny"
    assert "4 layers" in page.find_element("id", "run-model").text
    stage_rows = page.find_elements("css selector", "#stages tbody tr")
    assert [row.find_element("tag name", "td").text for row in stage_rows] == list(STAGES)
    assert "verifiable" in stage_rows[0].text and "75% of" in stage_rows[1].text
    assert page.find_element("id", "tokens-per-s").text == "5.1K"
    # the learning curve: a training-loss and an eval-loss line
    assert len(page.find_elements("css selector", "#loss-chart svg path")) == 2
    assert "ago" in page.find_element("id", "updated").text
    source = page.page_source
    assert TICKET not in source and "/ip4/" not in source


def test_browser_hostile_name_renders_as_text_and_opens_no_dialog(page, monitor):
    page.get(f"{monitor.url}/")
    wait_for(page, "document.querySelectorAll('#leaderboard tbody tr').length", "no leaderboard row appeared")
    assert HOSTILE_NAME in leaderboard_names(page)
    assert page.execute_script("return document.scripts.length") == 2  # common.js and swarm.js, nothing injected
    assert no_dialog(page)
    link = page.find_element("link text", HOSTILE_NAME)
    link.click()
    wait_for(page, "document.querySelectorAll('#peers tbody tr').length", "the contributor's peers did not appear")
    assert page.find_element("id", "identity").text == HOSTILE_NAME
    assert unquote(page.current_url) == f"{monitor.url}/contributors/{HOSTILE_NAME}"
    assert no_dialog(page)


def test_browser_contributor_page_opens_from_its_row(page, monitor):
    page.get(f"{monitor.url}/")
    wait_for(page, "document.querySelectorAll('#leaderboard tbody tr').length", "no leaderboard row appeared")
    page.find_element("link text", "alice").click()
    wait_for(page, "document.querySelectorAll('#peers tbody tr').length", "alice's peers did not appear")
    assert page.current_url == f"{monitor.url}/contributors/alice"
    assert page.find_element("id", "identity").text == "alice"
    assert len(page.find_elements("css selector", "#peers tbody tr")) == 2  # one peer on head, one on tail
    assert len(page.find_elements("css selector", "#points-chart svg path")) == 2  # presence and verified compute
    page.get(f"{monitor.url}/contributors/carol")  # carol's compute is withheld: the page says why
    wait_for(page, "document.querySelectorAll('#peers tbody tr').length", "carol's peers did not appear")
    assert WITHHELD_REASON in page.find_element("id", "peers").text
    assert page.find_element("id", "withheld").text == "2.500"


def test_browser_page_refreshes_itself(page, monitor):
    page.get(f"{monitor.url}/")
    wait_for(page, "document.querySelectorAll('#leaderboard tbody tr').length", "no leaderboard row appeared")
    now = time.time()
    monitor.store.record_scrape(
        [Observation("QmNewcomer", "erin", "head", "r1", "sync1", 60.0, 0.0, now, now, "sync1")], {}, now
    )
    wait_for(
        page,
        "[...document.querySelectorAll('#leaderboard td.name a')].some(a => a.textContent === 'erin')",
        "the newcomer did not appear without a reload",
    )


def test_browser_screenshots_at_desktop_and_phone_width(page, monitor, tmp_path):
    page.get(f"{monitor.url}/")
    wait_for(page, "document.querySelectorAll('#loss-chart svg').length", "the learning curve did not appear")
    desktop = full_page_screenshot(page, tmp_path / "swarm-desktop.png")
    emulate_phone(page)
    page.get(f"{monitor.url}/")
    wait_for(page, "document.querySelectorAll('#leaderboard tbody tr').length", "no leaderboard row appeared")
    # readable on a phone: nothing wider than the screen, the wide tables scroll inside their own box
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    phone = full_page_screenshot(page, tmp_path / "swarm-phone.png")
    page.get(f"{monitor.url}/contributors/carol")  # her withheld compute and its reason
    wait_for(page, "document.querySelectorAll('#points-chart svg').length", "the points chart did not appear")
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    contributor = full_page_screenshot(page, tmp_path / "contributor-phone.png")
    for shot in (desktop, phone, contributor):
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"screenshots: {desktop} {phone} {contributor}")
