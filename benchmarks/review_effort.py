"""Clicks and time per verified label: the review site's grid flow against the pairwise flow, in a
scripted headless-Chromium session on the demo's review.

A scripted reviewer verifies every candidate of the demo benchmark twice, each time in a fresh
browser (an empty store), against the same answer key: a candidate matches when more than one
expert retrieved it (any fixed key works; what it sets is the share of matches a reviewer marks).

- **grid**: on each page, click every match; after a query's last page, "Reject the rest of this
  query" (one click); move on with "next page" and "next query" (one click each).
- **pairwise**: every candidate decided by itself, one key each (`a` or `r`), the fastest a
  one-pair-at-a-time flow gets; moving between pages and queries as above. The earlier Label Studio
  form (a task per pair) takes more: a choice, a submit and a page load per label, counted in the
  table, not measured.

Each action is one WebDriver call that waits for the page to answer, so the time is the software's
(rendering, storage) plus the driver's, not a person's; clicks and keys are what a person would do.

    .venv/bin/python benchmarks/review_effort.py [--review .rde/artifacts/build-secmm/demo/benchmark/review]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / ".rde" / "artifacts" / "build-secmm" / "demo" / "benchmark" / "review"


def _browser() -> webdriver.Chrome:  # noqa: F821 - selenium, imported inside
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chrome, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chrome and driver):
        sys.exit("needs Debian's chromium and chromium-driver (make browser)")
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def _queries(review: Path) -> list[dict]:
    out = []
    for n in range(1, 100_000):
        path = review / "data" / f"q{n}.js"
        if not path.exists():
            break
        out.append(json.loads(path.read_text(encoding="utf-8").removeprefix("RDE_REVIEW.query(").rstrip(";\n)")))
    return out


def session(review: Path, mode: str, page_size: int) -> dict[str, float]:
    """One scripted pass over every query; returns actions, labels and seconds."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    queries = _queries(review)
    browser = _browser()
    actions = labels = 0

    def progress(expected: str) -> None:
        WebDriverWait(browser, 20, poll_frequency=0.005, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda b: b.find_element(By.ID, "query-progress").text.startswith(expected))

    try:
        browser.get((review / "index.html").as_uri() + "#q/1/1")
        started = time.perf_counter()
        for q in queries:
            matches = [len(c[2].split(", ")) > 1 for c in q["candidates"]]
            pages = max(1, -(-len(matches) // page_size))
            decided = 0
            for page in range(1, pages + 1):
                if page > 1:
                    browser.find_element(By.CSS_SELECTOR, f"a[href='#q/{q['n']}/{page}']").click()
                    actions += 1
                progress(f"{decided} / ")
                tiles = browser.find_elements(By.CSS_SELECTOR, ".tile")
                for k, tile in enumerate(tiles):
                    match = matches[(page - 1) * page_size + k]
                    if mode == "pairwise":
                        tile.send_keys("a" if match else "r")
                    elif match:
                        tile.click()
                    else:
                        continue
                    actions += 1
                    decided += 1
                    progress(f"{decided} / ")
            if mode == "grid":
                browser.find_element(By.ID, "reject-query").click()
                actions += 1
            progress(f"{len(matches)} / ")
            labels += len(matches)
            if q["n"] < len(queries):
                browser.find_element(By.CSS_SELECTOR, f"a[href='#q/{q['n'] + 1}/1']").click()
                actions += 1
        seconds = time.perf_counter() - started
    finally:
        browser.quit()
    return {"actions": actions, "labels": labels, "seconds": seconds,
            "matches": sum(len(c[2].split(", ")) > 1 for q in queries for c in q["candidates"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--review", type=Path, default=DEFAULT, help="a benchmark's review folder")
    args = parser.parse_args()
    index = args.review / "data" / "index.js"
    if not index.exists():
        sys.exit(f"{index} not found: run `make demo` first (or pass --review)")
    page_size = json.loads(index.read_text(encoding="utf-8").removeprefix("RDE_REVIEW.index(").rstrip(";\n)"))[
        "page_size"]
    grid, pairwise = session(args.review, "grid", page_size), session(args.review, "pairwise", page_size)
    labels = grid["labels"]
    print(f"{labels} candidates of {len(_queries(args.review))} queries, {grid['matches']} matches "
          f"({grid['matches'] / labels:.0%}), {page_size} per page")
    print("| flow | clicks + keys | per verified label | page loads | seconds per label (scripted) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("grid (marks + reject the rest)", grid), ("pairwise (a key per candidate)", pairwise)):
        print(f"| {name} | {r['actions']} | {r['actions'] / labels:.3f} | 1 | {r['seconds'] / labels:.4f} |")
    print(f"| Label Studio, a task per pair (counted) | {2 * labels} | 2.000 | {labels} | – |")
    print(f"grid / pairwise: {grid['actions'] / pairwise['actions']:.2f}× the actions, "
          f"{grid['seconds'] / pairwise['seconds']:.2f}× the scripted time")


if __name__ == "__main__":
    main()
