"""Debian's headless chromium driven by Selenium through Debian's chromedriver, for the public page's tests and
bench/page.py. Nothing is downloaded: without both binaries (`.ci/run` installs them) the caller skips."""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-extensions",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-component-update",
    "--disable-background-networking",  # the browser's own calls home: the tests watch the page's requests only
)


def browser_missing() -> str | None:
    """Why no headless browser can run here; None if one can."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not installed: `apt-get install chromium chromium-driver` "
            "(.ci/run does) to test the page in a real browser"
        )
    if importlib.util.find_spec("selenium") is None:
        return "selenium not installed: `pip install -r requirements-dev.txt`"
    return None


def start_chromium(width: int = 1280, height: int = 900, extra_args: tuple[str, ...] = ()) -> Any:
    """A headless chromium that keeps its console and network (performance) logs and leaves dialogs open;
    ``extra_args``: more of chromium's flags."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in (*CHROMIUM_ARGS, f"--window-size={width},{height}", *extra_args):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    options.set_capability("unhandledPromptBehavior", "ignore")  # an alert() stays open, for the test to see
    return webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))


def emulate_phone(driver: Any, width: int = 390, height: int = 844) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 2, "mobile": True}
    )


def emulate_desktop(driver: Any) -> None:
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def full_page_screenshot(driver: Any, path: Path) -> Path:
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def requested_urls(driver: Any) -> list[str]:
    """Every URL the page asked for since the last call (the DevTools network events in the performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def console_errors(driver: Any) -> list[str]:
    """Console messages of level SEVERE (errors, CSP violations, failed loads) since the last call."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
