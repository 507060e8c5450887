"""The public page's time to first render (issue 32): a monitor's HTTP server on 127.0.0.1 holding a recorded swarm of
`--contributors` (1,000) contributors (tests/recorded_swarm.py: six scrapes, receipts, a learning curve), and Debian's
headless chromium (through chromedriver, as the tests drive it) loading `/` `--runs` (5) times with its HTTP cache off.

Per load, from the browser's own timing API: the first contentful paint (the page's frame, before its data) and the
page's `agora-first-render` mark (performance.mark: the run, stages, learning curve and every leaderboard row drawn from
the JSON API), both from the start of navigation; and that every row is in the DOM. Also the server's time to answer
/leaderboard, /swarm and /learning (median of 20 each, httpx on a kept-alive connection) and their sizes.

Figures: `first_render_ms` (median mark; target < 1000), `first_render_max_ms`, `fcp_ms`, per-endpoint `api_ms` and
`api_bytes`. Usage: python bench/page.py [--contributors 1000] [--runs 5]; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: agora_client, and tests/'s helpers
from agora_client.monitor.http_api import LeaderboardServer  # noqa: E402
from tests.browser import browser_missing, console_errors, start_chromium  # noqa: E402
from tests.recorded_swarm import record_swarm  # noqa: E402

RENDER_TIMEOUT_S = 30.0
TIMINGS = """
const mark = performance.getEntriesByName("agora-first-render")[0];
const paint = performance.getEntriesByName("first-contentful-paint")[0];
return mark ? {render: mark.startTime, fcp: paint ? paint.startTime : null,
               rows: document.querySelectorAll("#leaderboard tbody tr").length} : null;
"""


def api_timings(url: str) -> tuple[dict[str, float], dict[str, int]]:
    times, sizes = {}, {}
    with httpx.Client(timeout=10) as client:
        for path in ("/leaderboard", "/swarm", "/learning"):
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                reply = client.get(f"{url}{path}")
                samples.append((time.perf_counter() - start) * 1000)
            times[path], sizes[path] = round(statistics.median(samples), 2), len(reply.content)
    return times, sizes


def load_once(driver, url: str) -> dict[str, float]:
    driver.get(url)
    deadline = time.monotonic() + RENDER_TIMEOUT_S
    while (timings := driver.execute_script(TIMINGS)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the page did not render within {RENDER_TIMEOUT_S:g} s: {console_errors(driver)}")
        time.sleep(0.05)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contributors", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if (missing := browser_missing()) is not None:
        raise SystemExit(f"cannot run: {missing}")
    with tempfile.TemporaryDirectory(prefix="agora-page-bench-") as folder:
        start = time.perf_counter()
        store, run = record_swarm(Path(folder) / "points.sqlite", now=time.time(), contributors=args.contributors)
        print(
            f"recorded a swarm of {args.contributors} contributors in {time.perf_counter() - start:.1f} s", flush=True
        )
        server = LeaderboardServer(store, run=run).start()
        driver = start_chromium()
        try:
            api_ms, api_bytes = api_timings(server.url)
            print(f"API medians (ms): {api_ms}; sizes (bytes): {api_bytes}", flush=True)
            driver.execute_cdp_cmd("Network.enable", {})
            driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
            loads = []
            for index in range(args.runs):
                timings = load_once(driver, f"{server.url}/")
                if timings["rows"] != args.contributors:
                    raise SystemExit(f"load {index}: {timings['rows']} leaderboard rows, expected {args.contributors}")
                loads.append(timings)
                print(
                    f"load {index}: first contentful paint {timings['fcp']:.0f} ms, first render "
                    f"{timings['render']:.0f} ms ({timings['rows']} rows)",
                    flush=True,
                )
            errors = console_errors(driver)
        finally:
            driver.quit()
            server.stop()
            store.close()
    renders = [load["render"] for load in loads]
    print(
        json.dumps(
            {
                "contributors": args.contributors,
                "runs": args.runs,
                "first_render_ms": round(statistics.median(renders), 1),
                "first_render_max_ms": round(max(renders), 1),
                "fcp_ms": round(statistics.median(load["fcp"] for load in loads if load["fcp"] is not None), 1),
                "api_ms": api_ms,
                "api_bytes": api_bytes,
                "console_errors": len(errors),
            }
        )
    )


if __name__ == "__main__":
    main()
