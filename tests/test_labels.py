"""Label refinement: both export forms, import from either (hand-edited too), id validation,
and the review site driven in headless Chromium (pages, keys, bulk actions → export → resume)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from browser import chromium_driver
from PIL import Image

from rde.secmm.label_import import merge_decisions
from rde.secmm.labels import (
    DecisionError,
    import_decisions,
    label_studio_tasks,
    latest_per_pair,
    read_decisions,
    review_order,
)
from rde.secmm.review_site import ReviewFiles, build_review, query_groups, thumbnail, write_thumbnails
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


def _ls_tasks(page_size: int = 2) -> list[dict]:
    by_query: dict[str, list[dict]] = {}
    for c in review_order(CANDIDATES):
        by_query.setdefault(c["query_id"], []).append(c)
    return [t for qid, cands in by_query.items()
            for t in label_studio_tasks(qid, QUERIES[qid]["text"], QUERIES[qid]["domain"], cands, page_size,
                                        lambda image_id: f"http://images.example/{image_id}.png")]


def test_label_studio_grid_tasks_decide_every_candidate_they_show(tmp_path: Path) -> None:
    """One task per query and page of its candidates; an annotation marks the matches, and every
    other candidate of the task is decided not relevant; a cancelled annotation decides nothing."""
    tasks = _ls_tasks()
    assert [(t["data"]["query_id"], t["data"]["page"], t["data"]["pages"]) for t in tasks] == \
        [("q1", 1, 2), ("q1", 2, 2), ("q2", 1, 1)]
    first = tasks[0]["data"]
    assert first["query"] == "a man in a red jacket" and [c["value"] for c in first["candidates"]] == ["img1", "img0"]
    assert 'src="http://images.example/img1.png"' in first["candidates"][0]["html"]
    tasks[0]["annotations"] = [{"result": [{"from_name": "matches", "to_name": "query", "type": "choices",
                                            "value": {"choices": ["img0"]}}],
                                "completed_by": {"email": "c@x"}, "created_at": "2026-11-30T09:00:00Z"}]
    tasks[1]["annotations"] = [{"result": [], "was_cancelled": True}]
    tasks[2]["annotations"] = [{"result": [], "completed_by": 7}]  # submitted with nothing marked: none match
    path = tmp_path / "ls.json"
    path.write_text(json.dumps(tasks))
    got = {(d.query_id, d.image_id): (d.relevant, d.annotator, d.tool) for d in import_decisions(path, PAIRS)}
    assert got == {("q1", "img0"): (True, "c@x", "label-studio"), ("q1", "img1"): (False, "c@x", "label-studio"),
                   ("q2", "img3"): (False, "7", "label-studio"), ("q2", "img4"): (False, "7", "label-studio")}
    tasks[0]["annotations"][0]["result"][0]["value"]["choices"] = ["img4"]  # not shown in that task
    path.write_text(json.dumps(tasks))
    with pytest.raises(DecisionError, match="not among its candidates: img4"):
        import_decisions(path, PAIRS)


def test_label_studio_pair_tasks_still_import(tmp_path: Path) -> None:
    """Exports of the earlier one-task-per-pair form keep importing."""
    tasks = [{"data": {"query_id": "q1", "image_id": "img0"},
              "annotations": [{"result": [{"value": {"choices": ["relevant"]}}], "completed_by": {"email": "c@x"}}]},
             {"data": {"query_id": "q1", "image_id": "img1"},
              "annotations": [{"result": [{"value": {"choices": ["not_relevant"]}}], "completed_by": 7}]}]
    path = tmp_path / "ls.json"
    path.write_text(json.dumps(tasks))
    got = {(d.query_id, d.image_id): (d.relevant, d.annotator) for d in import_decisions(path, PAIRS)}
    assert got == {("q1", "img0"): (True, "c@x"), ("q1", "img1"): (False, "7")}


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
    tasks = _ls_tasks()  # the first: q1's img1 and img0, both marked as matches at 12:00
    tasks[0]["annotations"] = [{"result": [{"value": {"choices": ["img1", "img0"]}}], "completed_by": {"email": "ls@x"},
                                "updated_at": "2026-12-01T12:00:00Z"}]
    studio = tmp_path / "ls.json"
    studio.write_text(json.dumps(tasks[:1]))
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


SITE_CANDIDATES = [{"query_id": "q1", "image_id": f"img{i}", "experts": ["a", "b"][: 1 + (i == 2)],
                    "best_rank": i + 1} for i in range(5)] + \
                  [{"query_id": "q2", "image_id": f"img{i}", "experts": ["b"], "best_rank": i} for i in (3, 4)]
SITE_PAIRS = [(c["query_id"], c["image_id"]) for c in SITE_CANDIDATES]


def _site(folder: Path, imported: dict | None = None) -> dict[str, int]:
    files = ReviewFiles(folder, "test benchmark", "key-1", page_size=2)
    return build_review(files, iter(SITE_CANDIDATES), QUERIES,
                        ({"image_id": k, "image_bytes": v} for k, v in IMAGES.items()), imported or {})


def test_review_site_files_are_per_query_with_thumbnails_as_files(tmp_path: Path) -> None:
    counts = _site(tmp_path)
    assert counts["queries"] == 2 and counts["candidates"] == 7 and counts["label_studio_tasks"] == 4
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["index.js", "q1.js", "q2.js"]
    assert (tmp_path / "images" / "img0.png").read_bytes() == IMAGES["img0"]  # small: copied as it is
    assert "base64" not in (tmp_path / "index.html").read_text()
    q1 = json.loads((tmp_path / "data" / "q1.js").read_text().removeprefix("RDE_REVIEW.query(").rstrip(";\n)"))
    assert [c[0] for c in q1["candidates"]] == ["img2", "img0", "img1", "img3", "img4"]  # two experts first
    tall = Image.fromarray(np.zeros((600, 200, 3), np.uint8))
    buf = io.BytesIO()
    tall.save(buf, "PNG")
    data, ext = thumbnail(buf.getvalue(), 256)
    assert ext == ".jpg" and Image.open(io.BytesIO(data)).size == (85, 256)
    # thumbnails are written once, and again when the height changes
    (tmp_path / "images" / "img0.png").write_bytes(b"kept")
    write_thumbnails([{"image_id": "img0", "image_bytes": buf.getvalue()}], tmp_path / "images", 256)
    assert (tmp_path / "images" / "img0.png").read_bytes() == b"kept"
    write_thumbnails([{"image_id": "img0", "image_bytes": buf.getvalue()}], tmp_path / "images", 100)
    assert not (tmp_path / "images" / "img0.png").exists()
    assert Image.open(tmp_path / "images" / "img0.jpg").size == (33, 100)
    # the images' URLs in Label Studio's tasks: its local-files serving, or a published folder
    local = ReviewFiles(tmp_path, "t", "k").image_url({"img0": "img0.png"})("img0")
    assert local == "/data/local-files/?d=" + str((tmp_path / "images" / "img0.png").resolve()).lstrip("/")
    remote = ReviewFiles(tmp_path, "t", "k", label_studio_images="https://reviews.example.org/demo/images/")
    assert remote.image_url({"img0": "img 0.png"})("img0") == "https://reviews.example.org/demo/images/img%200.png"
    bad = [*SITE_CANDIDATES, {"query_id": "q1", "image_id": "img0", "experts": ["a"], "best_rank": 9}]
    with pytest.raises(ValueError, match="candidates of query q1 are not together"):
        list(query_groups(iter(bad), QUERIES))


@pytest.mark.slow
def test_review_site_in_headless_chromium(tmp_path: Path, test_artifacts_dir: Path) -> None:
    """A reviewer pages through a query (click, keys, bulk actions), reloads and finds the decisions
    kept, sees an imported decision, exports; a second browser resumes from that export."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    imported = {("q2", "img3"): {"relevant": True, "decided_at": "2026-12-01T10:00:00+00:00", "annotator": "lee",
                                 "tool": "label-studio"}}
    _site(tmp_path, imported)
    index = (tmp_path / "index.html").as_uri()
    browser = chromium_driver()

    def text(element_id: str, expected: str, on=None) -> None:
        """Wait for the text; the views re-render, so an element found may be replaced meanwhile."""
        WebDriverWait(on or browser, 10, poll_frequency=0.05,
                      ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda b: expected in b.find_element(By.ID, element_id).text)

    def states() -> list[str]:
        return [("accept" if "accept" in t.get_attribute("class") else "reject" if "reject" in
                 t.get_attribute("class") else "-") for t in browser.find_elements(By.CSS_SELECTOR, ".tile")]

    try:
        browser.get(index)
        text("progress", "1 / 7 decided")  # the imported decision
        browser.find_element(By.ID, "annotator").send_keys("dana")
        browser.find_element(By.CSS_SELECTOR, "a[href='#q/1/1']").click()
        text("page", "page 1 of 3")
        tiles = browser.find_elements(By.CSS_SELECTOR, ".tile")
        assert [t.get_attribute("data-image") for t in tiles] == ["img2", "img0"]
        tiles[0].click()  # accept
        tiles[1].click()
        tiles[1].click()  # accept → reject
        text("query-progress", "2 / 5 decided")
        browser.switch_to.active_element.send_keys("n")  # next page
        text("page", "page 2 of 3")
        browser.find_elements(By.CSS_SELECTOR, ".tile")[0].send_keys("A")  # accept the rest of this page
        text("query-progress", "4 / 5 decided")
        browser.find_element(By.CSS_SELECTOR, "a[href='#q/1/3']").click()
        text("page", "page 3 of 3")
        browser.find_element(By.ID, "reject-query").click()
        text("query-progress", "5 / 5 decided")
        browser.get(index + "#q/1/1")
        browser.refresh()  # a closed and re-opened tab: the decisions were saved as they were made
        text("query-progress", "5 / 5 decided")
        assert states() == ["accept", "reject"]
        browser.get(index + "#q/2/1")
        text("query-progress", "1 / 2 decided")
        assert states() == ["accept", "-"] and "label-studio" in browser.find_element(By.CSS_SELECTOR, ".badge").text
        browser.get(index + "#")
        text("progress", "6 / 7 decided")
        browser.save_screenshot(str(test_artifacts_dir / "review_index.png"))
        browser.get(index + "#q/1/2")
        text("page", "page 2 of 3")
        browser.save_screenshot(str(test_artifacts_dir / "review_query.png"))
        browser.find_element(By.ID, "export").click()
        text("export-output", "decisions")
        exported = browser.find_element(By.ID, "export-output").text
    finally:
        browser.quit()
    out = tmp_path / "decisions.json"
    out.write_text(exported)
    got = {(d.query_id, d.image_id): (d.relevant, d.annotator) for d in import_decisions(out, SITE_PAIRS)}
    assert got == {("q1", "img2"): (True, "dana"), ("q1", "img0"): (False, "dana"), ("q1", "img1"): (True, "dana"),
                   ("q1", "img3"): (True, "dana"), ("q1", "img4"): (False, "dana")}
    fresh = chromium_driver()  # another browser, empty store: resume from the exported file
    try:
        fresh.get(index + "#q/1/1")
        text("query-progress", "0 / 5 decided", fresh)
        fresh.find_element(By.ID, "resume").send_keys(str(out))
        text("query-progress", "5 / 5 decided", fresh)
        # a browser that refuses IndexedDB: decisions live in the tab, a banner says so, and the
        # export holds exactly the decisions made (the tab's progress records are not among them)
        fresh.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                              {"source": "Object.defineProperty(window, 'indexedDB', {get: () => undefined});"})
        fresh.get(index + "#q/2/1")
        fresh.refresh()
        text("warn", "decisions live only in this tab", fresh)
        fresh.find_elements(By.CSS_SELECTOR, ".tile")[1].click()
        text("query-progress", "2 / 2 decided", fresh)
        fresh.find_element(By.ID, "export").click()
        text("export-output", "decisions", fresh)
        in_tab = json.loads(fresh.find_element(By.ID, "export-output").text)["decisions"]
        assert [(d["query_id"], d["image_id"], d["decision"]) for d in in_tab] == [("q2", "img4", "accept")]
    finally:
        fresh.quit()


def test_review_scale_benchmark_runs_small(tmp_path: Path) -> None:
    """The review-at-scale benchmark end to end on a small draw: both sizes build, the table prints."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "review_scale.py"), "--images", "300",
                           "--queries", "10", "--per-query", "60", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=True)
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in done.stdout.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert [v.strip() for v in rows["candidates"]] == ["60", "600", "10.00"]
    assert [v.strip() for v in rows["Label Studio tasks"]] == ["2", "20", "10.00"]  # 60 candidates: 48 + 12
    assert len(list((tmp_path / "review-10" / "data").glob("q*.js"))) == 10
