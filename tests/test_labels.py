"""Label refinement: both export forms, import from either (hand-edited too), id validation,
and the HTML review page driven in headless Chromium (click + keys → export → import)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from rde.secmm.label_import import merge_decisions
from rde.secmm.labels import (
    DecisionError,
    import_decisions,
    label_studio_tasks,
    latest_per_pair,
    read_decisions,
    review_order,
    review_page,
)
from storage import Artifact, ArtifactWriter, content_key

QUERIES = {"q1": {"query_id": "q1", "domain": "pedestrian", "text": "a man in a red jacket"},
           "q2": {"query_id": "q2", "domain": "vehicle", "text": "a white van"}}
CANDIDATES = [{"query_id": "q1", "image_id": f"img{i}", "domain": "pedestrian", "experts": ["a", "b"][: 1 + i % 2],
               "best_rank": i + 1} for i in range(3)] + \
             [{"query_id": "q2", "image_id": f"img{i}", "domain": "vehicle", "experts": ["b"], "best_rank": i}
              for i in range(3, 5)]
PAIRS = [(c["query_id"], c["image_id"]) for c in CANDIDATES]


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 32, 3), colour, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


IMAGES = {f"img{i}": _png((40 * i, 100, 200 - 30 * i)) for i in range(5)}


def test_hand_edited_review_export_imports(tmp_path: Path) -> None:
    path = tmp_path / "decisions.json"
    path.write_text(json.dumps({"annotator": "ana", "decisions": [
        {"query_id": "q1", "image_id": "img0", "decision": "accept"},
        {"query_id": "q1", "image_id": "img1", "decision": "reject", "decided_at": "2026-11-30T10:00:00+00:00"},
        {"query_id": "q1", "image_id": "img0", "decision": "reject", "annotator": "bo"},  # changed their mind
    ]}))
    got = {(d.query_id, d.image_id): d for d in import_decisions(path, PAIRS)}
    assert set(got) == {("q1", "img0"), ("q1", "img1")}
    assert got[("q1", "img0")].relevant is False and got[("q1", "img0")].annotator == "bo"
    assert got[("q1", "img1")].annotator == "ana" and got[("q1", "img1")].decided_at.startswith("2026-11-30")


def test_label_studio_export_imports(tmp_path: Path) -> None:
    tasks = label_studio_tasks(CANDIDATES, QUERIES, {k: f"/data/local-files/?d=/x/{k}.png" for k in IMAGES})
    assert tasks[0]["data"]["query"] == "a man in a red jacket" and tasks[0]["data"]["image"].endswith("img0.png")
    tasks[0]["annotations"] = [{"result": [{"value": {"choices": ["relevant"]}}], "completed_by": {"email": "c@x"},
                                "created_at": "2026-11-30T09:00:00Z"}]
    tasks[1]["annotations"] = [{"result": [{"value": {"choices": ["not_relevant"]}}], "completed_by": 7}]
    tasks[2]["annotations"] = [{"result": [], "was_cancelled": True}]
    path = tmp_path / "ls.json"
    path.write_text(json.dumps(tasks))
    got = {(d.query_id, d.image_id): d for d in import_decisions(path, PAIRS)}
    assert got[("q1", "img0")].relevant and got[("q1", "img0")].annotator == "c@x"
    assert not got[("q1", "img1")].relevant and got[("q1", "img1")].annotator == "7"
    assert ("q1", "img2") not in got


def test_unknown_ids_and_bad_files_are_rejected_with_a_message(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"decisions": [{"query_id": "q9", "image_id": "img0", "decision": "accept"},
                                              {"query_id": "q1", "image_id": "nope", "decision": "accept"}]}))
    with pytest.raises(DecisionError, match=r"2 decisions name pairs that are not candidates.*\(q9, img0\)"):
        import_decisions(path, PAIRS)
    path.write_text(json.dumps({"decisions": [{"query_id": "q1", "image_id": "img0", "decision": "maybe"}]}))
    with pytest.raises(DecisionError, match="unknown decision 'maybe'"):
        import_decisions(path, PAIRS)
    path.write_text("{not json")
    with pytest.raises(DecisionError, match="not readable JSON"):
        import_decisions(path, PAIRS)
    path.write_text(json.dumps({"something": 1}))
    with pytest.raises(DecisionError, match="expected the review page's export"):
        import_decisions(path, PAIRS)


def test_conflicting_decisions_keep_the_latest_and_are_counted(tmp_path: Path) -> None:
    """The latest decided_at wins whatever the file order ('Z' and '+00:00' alike); equal times go to
    the one read last; pairs that disagree are counted, agreeing repeats are not."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"annotator": "ana", "decisions": [
        {"query_id": "q1", "image_id": "img0", "decision": "accept", "decided_at": "2026-12-01T10:00:00Z"},
        {"query_id": "q1", "image_id": "img0", "decision": "reject", "annotator": "bo",
         "decided_at": "2026-12-01T09:00:00+00:00"},  # later in the file, earlier in time
        {"query_id": "q1", "image_id": "img1", "decision": "reject", "decided_at": "2026-12-01T08:00:00"},
        {"query_id": "q1", "image_id": "img1", "decision": "reject", "decided_at": "2026-12-01T08:30:00"},
        {"query_id": "q1", "image_id": "img2", "decision": "accept", "decided_at": "2026-12-01T07:00:00Z"},
        {"query_id": "q1", "image_id": "img2", "decision": "reject", "annotator": "cy",
         "decided_at": "2026-12-01T07:00:00+00:00"},  # the same time: the one read last
    ]}))
    kept, conflicts = latest_per_pair(read_decisions(path, PAIRS))
    got = {(d.query_id, d.image_id): d for d in kept}
    assert got[("q1", "img0")].relevant and got[("q1", "img0")].annotator == "ana"
    assert got[("q1", "img2")].annotator == "cy" and not got[("q1", "img2")].relevant
    assert conflicts == 2 and {d.tool for d in kept} == {"review-page"}


def test_imports_merge_by_time_and_keep_their_tool(tmp_path: Path) -> None:
    """A Label Studio decision at 12:00, then a review-page file with an older and a newer decision:
    the older one loses to what was imported (counted), the newer one replaces it; each kept row
    says which tool it came from."""
    schema = pa.schema([pa.field("query_id", pa.string()), pa.field("image_id", pa.string())])
    candidates = str(tmp_path / "candidates")
    writer = ArtifactWriter(candidates, "candidates", schema, content_key(kind="test-candidates"))
    writer.begin()
    writer.finalize([writer.write_shard(0, pa.Table.from_pylist(
        [{"query_id": q, "image_id": i} for q, i in PAIRS], schema=schema))], code_version="test")
    tasks = label_studio_tasks(CANDIDATES, QUERIES, {k: f"https://store/{k}.png" for k in IMAGES})
    for task in tasks[:2]:
        task["annotations"] = [{"result": [{"value": {"choices": ["relevant"]}}], "completed_by": {"email": "ls@x"},
                                "updated_at": "2026-12-01T12:00:00Z"}]
    studio = tmp_path / "ls.json"
    studio.write_text(json.dumps(tasks))
    decisions = str(tmp_path / "decisions")
    first = merge_decisions(decisions, candidates, studio, "test")
    assert first == {"imported": 2, "new_pairs": 2, "conflicts": 0, "older_than_kept": 0, "total": 2, "relevant": 2}
    page = tmp_path / "page.json"
    page.write_text(json.dumps({"annotator": "ana", "decisions": [
        {"query_id": "q1", "image_id": "img0", "decision": "reject", "decided_at": "2026-12-01T11:00:00Z"},
        {"query_id": "q1", "image_id": "img1", "decision": "reject", "decided_at": "2026-12-01T13:00:00Z"},
        {"query_id": "q2", "image_id": "img3", "decision": "accept", "decided_at": "2026-12-01T13:00:00Z"}]}))
    second = merge_decisions(decisions, candidates, page, "test")
    assert second == {"imported": 3, "new_pairs": 1, "conflicts": 2, "older_than_kept": 1, "total": 3,
                      "relevant": 2}
    rows = {(r["query_id"], r["image_id"]): r for r in Artifact(decisions).rows()}
    assert rows[("q1", "img0")]["relevant"] and rows[("q1", "img0")]["tool"] == "label-studio"
    assert not rows[("q1", "img1")]["relevant"] and rows[("q1", "img1")]["tool"] == "review-page"
    assert rows[("q2", "img3")]["annotator"] == "ana" and rows[("q1", "img0")]["annotator"] == "ls@x"


def test_likely_matches_come_first_within_each_query() -> None:
    mixed = [{"query_id": "q2", "image_id": "a", "experts": ["x"], "best_rank": 1},
             {"query_id": "q1", "image_id": "b", "experts": ["x"], "best_rank": 3},
             {"query_id": "q1", "image_id": "c", "experts": ["x", "y"], "best_rank": 9},
             {"query_id": "q2", "image_id": "d", "experts": ["x", "y", "z"], "best_rank": 40},
             {"query_id": "q1", "image_id": "e", "experts": ["y"], "best_rank": 2}]
    assert [c["image_id"] for c in review_order(mixed)] == ["d", "a", "c", "e", "b"]


def _chromium():
    chrome, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chrome and driver):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (see .ci/run)")
        pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--no-first-run",
                "--window-size=1200,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.mark.slow
def test_review_page_in_headless_chromium(tmp_path: Path, test_artifacts_dir: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page = tmp_path / "review.html"
    page.write_text(review_page(CANDIDATES, QUERIES, IMAGES, "test benchmark"), encoding="utf-8")
    browser = _chromium()
    try:
        browser.get(page.as_uri())
        tiles = browser.find_elements(By.CSS_SELECTOR, ".tile")
        assert len(tiles) == 5 and "0 / 5 decided" in browser.find_element(By.ID, "progress").text
        tiles[0].click()  # accept
        tiles[1].click()
        tiles[1].click()  # accept → reject
        tiles[2].click()
        tiles[2].click()
        tiles[2].click()  # accept → reject → undecided
        browser.find_element(By.ID, "annotator").send_keys("dana")
        tiles[3].send_keys("a")  # keyboard: accept, focus moves to the next tile
        browser.switch_to.active_element.send_keys("r")  # reject tiles[4]
        assert "4 / 5 decided" in browser.find_element(By.ID, "progress").text
        assert "accept" in tiles[0].get_attribute("class") and "reject" in tiles[4].get_attribute("class")
        browser.switch_to.active_element.send_keys(Keys.ARROW_LEFT)
        browser.find_element(By.ID, "export").click()
        exported = browser.find_element(By.ID, "export-output").text
        browser.save_screenshot(str(test_artifacts_dir / "review_page.png"))
    finally:
        browser.quit()
    out = tmp_path / "decisions.json"
    out.write_text(exported)
    got = {(d.query_id, d.image_id): (d.relevant, d.annotator) for d in import_decisions(out, PAIRS)}
    assert got == {("q1", "img0"): (True, "dana"), ("q1", "img1"): (False, "dana"),
                   ("q2", "img3"): (True, "dana"), ("q2", "img4"): (False, "dana")}
