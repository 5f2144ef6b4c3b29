"""The reports of a comparison (``rde.evaluation.report``) and its terminal tables
(``entry.evaluation_table``), on a comparison built by hand: three models, two domains, a
reference with paired differences, pending labels and per-query outcomes with known worst
queries."""

from __future__ import annotations

import io
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import ClassVar

import pandas as pd
import pytest
from PIL import Image
from rich.console import Console

from entry.evaluation_table import comparison_table, differences_table
from rde.evaluation.report import comparison_rows, write_report
from rde.evaluation.report_cells import best_per_metric
from rde.evaluation.results import METRICS, Comparison, Interval, ModelResult, QueryOutcome

A, B, C = "transformers-clip:/models/clip", "open-clip:ViT-B-32", "siglip:/models/s<v2>"
# each model's overall mean; B is best everywhere but R@1, where C is (0.600)
BASE = {A: 0.40, B: 0.45, C: 0.42}
DOMAIN_SHIFT = {"pedestrian": {A: 0.10, B: 0.0, C: 0.0}, "vehicle": {A: -0.1, B: -0.1, C: 0.05}}
QUERIES = {"all": 12, "pedestrian": 7, "vehicle": 5}
# model A's per-query AP: worst ten (AP, then id) are q03 q01 q05 q06 q07 q08 q02 q09 q00 q10;
# q11 ties q00 and q10 at 0.7 but sorts after them, q04 is the best
AP_A = [0.7, 0.1, 0.5, 0.0, 1.0, 0.2, 0.3, 0.3, 0.4, 0.6, 0.7, 0.7]
WORST_A = ["q03", "q01", "q05", "q06", "q07", "q08", "q02", "q09", "q00", "q10"]
LINKS = {"q03": "https://review.example/q03.html", "q01": "http://127.0.0.1:8000/review/q01.html"}


def _iv(mean: float, half: float = 0.04) -> Interval:
    return Interval(round(mean, 3), round(mean - half, 3), round(mean + half, 3))


def _metrics(model: str) -> dict[str, dict[str, Interval]]:
    out: dict[str, dict[str, Interval]] = {}
    for domain in ("all", "pedestrian", "vehicle"):
        shift = DOMAIN_SHIFT.get(domain, {}).get(model, 0.0)
        out[domain] = {k: _iv(BASE[model] + shift + (0.18 if model == C and k == "R@1" else 0.0)) for k in METRICS}
    return out


def _outcome(k: int, ap: float) -> QueryOutcome:
    """Query q<k>: top items t<k>a..e, relevant t<k>c and r<k> (q02 has seven relevant items);
    q01's top holds an item with no image, q05's one whose bytes are not an image."""
    top = [f"t{k}{c}" for c in "abcde"]
    if k == 1:
        top[4] = "gone-1"
    if k == 5:
        top[4] = "bad-5"
    relevant = tuple(f"r2-{j}" for j in range(7)) if k == 2 else (f"t{k}c", f"r{k}")
    text = "a man <b>in red</b> & a bag" if k == 3 else f"query number {k}"
    return QueryOutcome(f"q{k:02d}", "pedestrian" if k < 7 else "vehicle", text, ap,
                        None if ap == 0.0 else 1 + int(10 * (1 - ap)), tuple(top), relevant)


def _comparison(labels: str = "pending", reference: str | None = A) -> Comparison:
    models = []
    for i, name in enumerate((A, B, C)):
        aps = AP_A if name == A else [((k * (i + 5)) % 12) / 12 for k in range(12)]
        diff = None
        if reference and name == B:
            diff = {k: Interval(0.031, 0.004, 0.058) for k in METRICS}
        elif reference and name == C:
            diff = {k: Interval(0.012, -0.02, 0.04) for k in METRICS} | {"R@1": Interval(-0.05, -0.09, -0.01)}
        models.append(ModelResult(name, _metrics(name), dict(QUERIES), [_outcome(k, ap) for k, ap in enumerate(aps)],
                                  difference=diff))
    return Comparison("secmm-demo", labels, models, reference=reference, review_links=dict(LINKS))


def _jpeg(colour: tuple[int, int, int], size: tuple[int, int] = (40, 300)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="JPEG")
    return out.getvalue()


class ImageSource:
    """Real JPEG bytes for every id but ``gone-*`` (unknown) and ``bad-*`` (not an image); records calls."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, ids: list[str]) -> dict[str, bytes]:
        self.calls.append(list(ids))
        return {i: (b"not an image" if i.startswith("bad") else _jpeg((len(i) * 20 % 255, 90, 160)))
                for i in ids if not i.startswith("gone")}


class Structure(HTMLParser):
    """Checks the nesting of a page's elements and counts tags, ``<img>`` sources and links."""

    VOID: ClassVar[set[str]] = {"img", "br", "meta", "link", "hr", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.count: dict[str, int] = {}
        self.closed: dict[str, int] = {}
        self.img_src: list[str] = []
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.count[tag] = self.count.get(tag, 0) + 1
        attr = dict(attrs)
        if tag == "img":
            self.img_src.append(attr.get("src") or "")
        if tag == "a":
            self.hrefs.append(attr.get("href") or "")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.count[tag] = self.count.get(tag, 0) + 1
        if tag == "img":
            self.img_src.append(dict(attrs).get("src") or "")

    def handle_endtag(self, tag: str) -> None:
        self.closed[tag] = self.closed.get(tag, 0) + 1
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def _parse(text: str) -> Structure:
    parser = Structure()
    parser.feed(text)
    parser.close()
    return parser


def _shown_items(comparison: Comparison, worst: dict[str, list[str]]) -> tuple[int, int]:
    """The numbers of thumbnails and of grey boxes the worst-query sections must show: of the top 5
    and up to 5 relevant items of each worst query, those with a readable image are thumbnails,
    those without (``gone-*``) or with unreadable bytes (``bad-*``) grey boxes."""
    thumbs = boxes = 0
    for m in comparison.models:
        by_id = {q.query_id: q for q in m.per_query}
        for qid in worst[m.model]:
            q = by_id[qid]
            shown = (*q.top[:5], *q.relevant[:5])
            boxes += sum(1 for i in shown if i.startswith(("gone", "bad")))
            thumbs += len(shown) - sum(1 for i in shown if i.startswith(("gone", "bad")))
    return thumbs, boxes


def _worst_ids(html: str) -> dict[str, list[str]]:
    """Per model, the query ids of its worst-query section, in page order."""
    out = {}
    for section in html.split("<h2>Worst queries: ")[1:]:
        name = section.split("</h2>", 1)[0].replace("&lt;", "<").replace("&gt;", ">")
        out[name] = re.findall(r'class="id">(q\d+) · ', section)
    return out


# --- Markdown --------------------------------------------------------------------------------------


def test_markdown_flags_pending_labels_and_bolds_the_best(tmp_path: Path) -> None:
    text = write_report(tmp_path / "r.md", _comparison()).read_text(encoding="utf-8")
    title = text.splitlines()[0]
    assert title.startswith("# secmm-demo") and "PENDING LABELS" in title
    overall = text.split("## Overall", 1)[1].split("##", 1)[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in overall.splitlines() if line.startswith("| ")}
    assert "**0.450 [0.410, 0.490]**" in rows[B] and "**" not in rows[A]
    assert "**0.600 [0.560, 0.640]**" in rows[C]  # C is best on R@1 only
    assert rows[B].count("**") == 2 * (len(METRICS) - 1) and rows[C].count("**") == 2
    diffs = text.split("## Paired difference against", 1)[1].split("## Domain", 1)[0]
    assert "+0.031 [+0.004, +0.058] \\*" in diffs  # significant: marked
    assert "+0.012 [-0.020, +0.040] |" in diffs  # straddles 0: unmarked
    assert "-0.050 [-0.090, -0.010] \\*" in diffs
    vehicle = text.split("## Domain: vehicle", 1)[1]
    assert "**0.470 [0.430, 0.510]**" in vehicle  # C leads on vehicles
    pedestrian = text.split("## Domain: pedestrian", 1)[1].split("##", 1)[0]
    assert "**0.500 [0.460, 0.540]**" in pedestrian  # A leads on pedestrians


def test_markdown_without_reference_or_pending_has_neither(tmp_path: Path) -> None:
    text = write_report(tmp_path / "r.md", _comparison(labels="verified", reference=None)).read_text(encoding="utf-8")
    assert "PENDING" not in text and "Paired difference" not in text
    assert text.splitlines()[0] == "# secmm-demo · labels: verified"


# --- CSV -------------------------------------------------------------------------------------------


def test_csv_has_one_row_per_model_domain_and_metric(tmp_path: Path) -> None:
    frame = pd.read_csv(write_report(tmp_path / "r.csv", _comparison()))
    assert list(frame.columns) == ["model", "domain", "metric", "mean", "low", "high", "queries", "labels",
                                   "benchmark", "diff_mean", "diff_low", "diff_high"]
    assert len(frame) == 3 * 3 * len(METRICS)
    assert not frame.duplicated(["model", "domain", "metric"]).any()
    row = frame[(frame.model == C) & (frame.domain == "all") & (frame.metric == "R@1")].iloc[0]
    assert (row["mean"], row["low"], row["high"], row["queries"]) == (0.6, 0.56, 0.64, 12)
    assert (row["diff_mean"], row["diff_low"], row["diff_high"]) == (-0.05, -0.09, -0.01)
    assert set(frame.labels) == {"pending"} and set(frame.benchmark) == {"secmm-demo"}
    assert frame[frame.domain == "vehicle"].queries.eq(5).all()
    # a difference only on the overall rows of the models that are not the reference
    has_diff = frame[frame.diff_mean.notna()]
    assert set(has_diff.model) == {B, C} and set(has_diff.domain) == {"all"} and len(has_diff) == 2 * len(METRICS)


# --- HTML ------------------------------------------------------------------------------------------


def test_html_is_offline_well_formed_with_inline_thumbnails(tmp_path: Path) -> None:
    comparison, source = _comparison(), ImageSource()
    html = write_report(tmp_path / "r.html", comparison, images=source).read_text(encoding="utf-8")
    page = _parse(html)
    assert page.errors == [] and page.stack == []
    assert page.count["svg"] == page.closed["svg"] == len(METRICS) + 3  # a bar chart per metric, a histogram per model
    worst = _worst_ids(html)
    thumbs, boxes = _shown_items(comparison, worst)
    assert page.count.get("img", 0) == thumbs and html.count('class="missing') == boxes > 0
    assert "+2 more" in html  # q02's two relevant items past the fifth
    assert page.img_src and all(src.startswith("data:image/jpeg;base64,") for src in page.img_src)
    for src in page.img_src[:3]:  # real thumbnails, downscaled
        import base64

        img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        assert img.format == "JPEG" and max(img.size) <= 96
    assert 'class="missing" title="gone-1">gone-1<' in html and 'title="bad-5">bad-5<' in html
    assert len(source.calls) == 1  # every image asked for at once
    urls = set(re.findall(r"https?://[^\s\"'<>]+", html))
    assert urls == set(LINKS.values())
    assert f'<a href="{LINKS["q03"]}">' in html
    assert "<b>in red</b>" not in html and "&lt;b&gt;in red&lt;/b&gt; &amp; a bag" in html
    assert "<v2>" not in html and "s&lt;v2&gt;" in html
    assert "<script" not in html and "<link" not in html and "@import" not in html


def test_html_worst_queries_are_the_lowest_ap_ties_by_id(tmp_path: Path) -> None:
    comparison = _comparison()
    html = write_report(tmp_path / "r.html", comparison).read_text(encoding="utf-8")
    worst = _worst_ids(html)
    assert worst[A] == WORST_A
    for m in comparison.models:
        aps = {q.query_id: q.ap for q in m.per_query}
        shown, rest = worst[m.model], set(aps) - set(worst[m.model])
        assert len(shown) == 10 and max(aps[q] for q in shown) <= min(aps[q] for q in rest)


def test_html_histogram_counts_per_query_ap_in_ten_bins(tmp_path: Path) -> None:
    html = write_report(tmp_path / "r.html", _comparison()).read_text(encoding="utf-8")
    section = html.split("Per-query AP", 1)[1].split("<h2>", 1)[0]
    first = section.split('<div class="chart">')[1]  # model A's
    counts = [int(n) for n in re.findall(r"<title>AP \d\.\d–\d\.\d: (\d+)</title>", first)]
    assert counts == [1, 1, 1, 2, 1, 1, 1, 3, 0, 1]  # AP 1.0 in the last bin
    assert section.count("<svg") == 3 and "mean AP 0.458" in first


def test_html_without_images_shows_ids_only(tmp_path: Path) -> None:
    html = write_report(tmp_path / "r.html", _comparison()).read_text(encoding="utf-8")
    page = _parse(html)
    assert page.errors == [] and page.count.get("img", 0) == 0 and "base64" not in html
    assert '<span class="id">t3a</span>' in html
    assert 'class="best" title="best">0.450 [0.410, 0.490]<' in html


# --- helpers and errors ----------------------------------------------------------------------------


def test_best_per_metric_prefers_the_first_model_on_a_tie() -> None:
    comparison = _comparison()
    assert best_per_metric(comparison) == {k: (C if k == "R@1" else B) for k in METRICS}
    comparison.models[0].metrics["all"]["MRR"] = _iv(0.45)  # A ties B, and comes first
    assert best_per_metric(comparison)["MRR"] == A
    assert best_per_metric(comparison, "vehicle")["mAP@20"] == C


def test_comparison_rows_are_plain_strings() -> None:
    rows = comparison_rows(_comparison())
    assert [r["model"] for r in rows] == [A, B, C]
    assert rows[2]["R@1"] == "0.600 [0.560, 0.640]" and rows[0]["queries"] == 12
    assert list(rows[0]) == ["model", *METRICS, "queries"]


def test_unknown_extension_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown format '\.xyz'; use \.md, \.csv or \.html"):
        write_report(tmp_path / "r.xyz", _comparison())
    write_report(tmp_path / "r.md", _comparison())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md"]  # no temporary file left beside it


def test_a_report_replaces_the_old_one_and_is_as_readable_as_a_plain_file(tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "r.csv").write_text("old")
    write_report(tmp_path / "r.csv", _comparison())
    assert (tmp_path / "r.csv").read_text().startswith("model,domain,metric")
    assert (tmp_path / "r.csv").stat().st_mode == (tmp_path / "plain.txt").stat().st_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt", "r.csv"]


# --- the terminal tables ---------------------------------------------------------------------------


def _render(*tables: object, width: int = 200) -> tuple[str, str]:
    """The tables as plain text and as text with ANSI styles."""
    console = Console(record=True, width=width, force_terminal=True, color_system="standard")
    for table in tables:
        console.print(table)
    return console.export_text(clear=False), console.export_text(styles=True)


def _bold_green(styled: str, text: str) -> bool:
    return re.search(r"\x1b\[1;32m *" + re.escape(text), styled) is not None


def test_rich_table_shows_best_in_bold_green_and_flags_pending() -> None:
    comparison = _comparison()
    plain, styled = _render(comparison_table(comparison), width=260)  # wide enough for one-line cells
    assert "PENDING LABELS" in plain and "12 queries (pedestrian 7, vehicle 5)" in plain
    assert _bold_green(styled, "0.450 [0.410, 0.490]") and _bold_green(styled, "0.600 [0.560, 0.640]")
    assert not _bold_green(styled, "0.420 [0.380, 0.460]") and "0.420 [0.380, 0.460]" in plain
    assert "\x1b[1;31mPENDING LABELS" in styled
    verified, _ = _render(comparison_table(_comparison(labels="verified")))
    assert "PENDING" not in verified


def test_rich_table_on_a_narrower_console_puts_the_interval_under_the_mean() -> None:
    plain, styled = _render(comparison_table(_comparison()), width=200)  # nine 20-character cells do not fit
    assert "PENDING LABELS" in plain
    assert _bold_green(styled, "0.450") and _bold_green(styled, "[0.410, 0.490]")
    assert plain.count("[0.380, 0.460]") == 8 and plain.count("[0.560, 0.640]") == 1  # never split inside
    assert not re.search(r"\[0\.\d{3}, *│", plain)


def test_rich_differences_table_marks_intervals_excluding_zero() -> None:
    table = differences_table(_comparison())
    assert table is not None
    plain, _ = _render(table, width=280)  # wide enough for one-line cells
    assert "+0.031 [+0.004, +0.058] *" in plain and "-0.050 [-0.090, -0.010] *" in plain
    assert "+0.012 [-0.020, +0.040] *" not in plain and "+0.012 [-0.020, +0.040]" in plain
    assert [line for line in plain.splitlines() if "transformers-clip" in line] == [plain.splitlines()[0]]  # title only
    assert plain.count(B) == 1
    narrow, _ = _render(table, width=200)
    assert narrow.count("+0.031 *") == len(METRICS) and narrow.count("-0.050 *") == 1 and "+0.012 *" not in narrow
    assert differences_table(_comparison(reference=None)) is None


def test_tables_name_a_local_model_by_its_file_and_a_hub_model_as_written() -> None:
    from entry.evaluation_table import short_name

    assert short_name("python:/home/me/code/my_retriever.py:make") == "python:my_retriever.py:make"
    assert short_name("student:./runs/train_saft") == "student:train_saft"
    hub = "transformers-clip:openai/clip-vit-base-patch32"
    assert short_name(hub) == hub
