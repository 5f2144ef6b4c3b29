"""End to end: build-largefine on a handful of demo images with the offline generator, and the
same flow through the transformers generator with a tiny random Qwen2-VL (production wiring)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from artifact_readers import assert_every_artifact_opens, run_card_snippet

from flows.build_largefine import build_largefine
from rde.largefine.caption_quality import gate_caption, repeated_sentence_share
from rde.largefine.card import corpus_statistics
from rde.profile import load_profile
from storage import Artifact
from storage.schemas import TIER_CAPTIONS
from tasks.framework.summary import summary_markdown

pytestmark = pytest.mark.slow

LARGEFINE = {"max_images": 6, "shard_size": 3, "templates": {"sample_captions": 4, "rounds": 1}}


def _small(pool_url: str, **extra: dict) -> dict:
    return {"input": {"kind": "pool", "path": pool_url}, "ingest": {"shard_size": 16}, "largefine": LARGEFINE,
            **extra}


def _stages(summary: dict) -> dict[str, dict]:
    return {s["stage"]: s for s in summary["stages"]}


class _Records(logging.Handler):
    """Keeps the messages Prefect logs during a run (flow, task and library loggers)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture(scope="module")
def run_logs() -> list[str]:
    return []


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory, small_pool_url: str,
                run_logs: list[str]) -> tuple[str, dict, dict]:
    out = str(tmp_path_factory.mktemp("largefine-out"))
    overrides = _small(small_pool_url)
    records = _Records()
    logging.getLogger("prefect").addHandler(records)
    try:
        summary = build_largefine(profile="demo", output_root=out, overrides=overrides)
    finally:
        logging.getLogger("prefect").removeHandler(records)
    run_logs += records.messages
    return out, summary, overrides


def test_every_image_and_tier_is_a_caption_or_a_rejected_row(offline_run: tuple[str, dict, dict]) -> None:
    out, summary, _ = offline_run
    assert summary["balanced"]
    root = Path(out, "build-largefine", "demo")
    chosen = Artifact(str(root / "neighbours")).rows()
    select_rejects = Artifact(str(root / "select_rejects")).rows()
    assert len(chosen) == 6 and len(chosen) + len(select_rejects) == summary["accepted"]
    assert {r["reason"] for r in select_rejects} <= {"not_sampled", "out_of_domain"}
    captions, rejects = Artifact(str(root / "largefine")).rows(), Artifact(str(root / "caption_rejects")).rows()
    # each chosen image ends each tier exactly once: as a caption or as a rejected row
    ended = [(r["image_id"], r["tier"]) for r in captions] + [(r["image_id"], r["stage"].removeprefix("tier-"))
                                                             for r in rejects]
    assert sorted(ended) == sorted((r["image_id"], tier) for r in chosen for tier in ("base", "inter", "adv"))
    # How many of the 18 survive is not the same on every CPU: SmolLM2's greedy decoding flips a
    # near-tie where the kernels round otherwise (16 on an AMD EPYC, 2026-12-04; 14 here on
    # 2026-12-06: 6 base, 4 inter, 4 adv). What is exact is why a row is rejected. Nothing else can
    # reject here: the Q&A steps are answered from the measured facts (no malformed_qa), each of
    # the 6 images has 5 distinct neighbours (no no_hard_negative), the gallery has templates (no
    # no_template). So a reject is the caption gate on an LLM summary, checked below by hand, or an
    # adv row whose base or inter was rejected (missing_tier_input), and nothing more.
    lf = load_profile("demo").largefine
    upstream = {r["image_id"] for r in rejects if r["stage"] in ("tier-base", "tier-inter")}
    assert {r["image_id"] for r in rejects if r["reason"] == "missing_tier_input"} == upstream
    assert len(captions) == 18 - len(rejects) and len([r for r in captions if r["tier"] == "adv"]) <= 6 - len(upstream)
    for r in rejects:
        if r["reason"] == "missing_tier_input":
            assert r["stage"] == "tier-adv", r
            continue
        assert r["reason"] in {"too_short", "too_long", "repetitive", "malformed_output", "ungrounded", "garbled"}, r
        if r["reason"] in ("too_short", "too_long"):  # words counted apart from the gate: by whitespace
            words = len(r["text"].split())
            assert words < lf.min_words if r["reason"] == "too_short" else words > lf.max_words, r
    # a floor as well: two thirds of the texts survive on the CPUs measured (14 and 16 of 18)
    assert len(captions) >= 12, f"too few captions survived the gates: {[r['reason'] for r in rejects]}"
    for row in captions:
        assert row["tier"] in ("base", "inter", "adv") and 10 <= row["words"] <= 200
        assert 0 < row["q_txt"] <= 1 and row["generator"].startswith("grounded-captioner")
        assert "gtr_tiers_small@" in row["prompt"]
        assert (row["template_id"] is not None) == (row["tier"] == "adv")
        assert row["hard_negative_id"] is None or row["tier"] != "base"
        assert "in the image" not in row["text"].lower() and "compare-image" not in row["text"].lower()
    shard = next(Path(root / "largefine").glob("part-*.parquet"))
    assert pq.read_schema(shard).names == TIER_CAPTIONS.names


def test_neighbours_are_distinct_images_and_hard_negatives_are_recorded(offline_run: tuple[str, dict, dict]) -> None:
    out, _, _ = offline_run
    for row in Artifact(str(Path(out, "build-largefine", "demo", "neighbours"))).rows():
        assert row["image_id"] not in row["neighbour_ids"] and row["hard_negative_id"] in row["neighbour_ids"]
        assert len(row["neighbour_ids"]) == 5  # k=10 but only 6 images chosen


def test_dataset_card_has_table1_statistics(offline_run: tuple[str, dict, dict]) -> None:
    out, _, _ = offline_run
    run_folder = Path(out, "build-largefine", "demo")
    folder = run_folder / "largefine"
    card = json.loads((run_folder / "card.json").read_text())
    assert card["table1"]["all"]["texts"] == Artifact(str(folder)).count_rows()
    assert card["table1"]["all"]["words_per_text"] >= 10 and card["table1"]["all"]["noun_chunks_per_text"] > 0
    assert "multi_granularity" in card and "#noun chunks/text" in (run_folder / "README.md").read_text()
    # the card adds up the tier shards' own counts (made where each shard was written): they equal
    # spaCy over every kept text at once (the same integer sums, divided once; 1e-12 for the division)
    texts = Artifact(str(folder)).to_pandas()
    whole = corpus_statistics({tier: list(texts[texts.tier == tier].text) for tier in texts.tier.unique()})
    assert card["table1"].keys() == whole.keys()
    for name, columns in whole.items():
        assert card["table1"][name] == pytest.approx(columns, rel=1e-12)
    tier12 = Artifact(str(run_folder / "tier12_captions")).manifest().stats
    assert tier12["table1.base.texts"] + tier12.get("table1.inter.texts", 0) == tier12["accepted"]
    manifest = Artifact(str(Path(out, "build-largefine", "demo", "tier12_captions"))).manifest()
    assert any(name.startswith("gtr_tiers_small") for name in manifest.prompt_versions)
    gallery = Artifact(str(Path(out, "build-largefine", "demo", "template_gallery"))).manifest()
    assert gallery.stats["gallery_version"].startswith("gallery-") and gallery.total_rows >= 4


def test_kept_texts_hold_no_repeated_sentence_and_say_how_they_were_cleaned(
        offline_run: tuple[str, dict, dict]) -> None:
    """a repeated sentence is dropped (first occurrence kept) before the gates decide,
    and each row records its generator output and what the cleaning removed."""
    out, _, _ = offline_run
    captions = Artifact(str(Path(out, "build-largefine", "demo", "largefine"))).rows()
    assert captions and all(repeated_sentence_share(r["text"]) == 0 for r in captions)
    lf = load_profile("demo").largefine
    for row in captions:  # the generator's output, gated again, gives the stored text and cleaning
        gate = gate_caption(row["raw_text"], min_words=lf.min_words, max_words=lf.max_words,
                            boilerplate=lf.boilerplate, max_repeated_sentence_share=lf.max_repeated_sentence_share,
                            negative_mentions=lf.negative_mentions if row["tier"] != "base" else ())
        assert (gate.reason, gate.text, list(gate.cleaning)) == (None, row["text"], row["cleaning"])
    # SmolLM2-135M repeats itself often: 5 of 16 kept texts were cleaned here (2026-12-04)
    assert any(r["cleaning"] for r in captions), "no text needed cleaning: the check above tested nothing"


def test_every_artifact_opens_with_pandas_pyarrow_and_datasets(offline_run: tuple[str, dict, dict],
                                                               tmp_path: Path) -> None:
    """the dataset card sits beside the artifact folders, never among the shards, and its snippet
    loads the captions from a copy of the folder on another path."""
    out, _, _ = offline_run
    run_folder = Path(out, "build-largefine", "demo")
    opened = {p.name for p in assert_every_artifact_opens(out, tmp_path / "hf")}
    assert {"largefine", "caption_rejects", "tier12_captions", "adv_captions", "select_rejects"} <= opened
    card = (run_folder / "README.md").read_text()
    assert str(Path(out).resolve()) not in card  # no path of the machine that built it
    # the card's own snippet, run in a copy of the folder elsewhere (the original moved away)
    ran = run_card_snippet(run_folder, tmp_path / "elsewhere" / "demo", tmp_path / "hf-card")
    assert len(ran["largefine"]) == ran["largefine_ds"].num_rows == Artifact(str(run_folder / "largefine")).count_rows()
    assert len(ran["caption_rejects"]) == Artifact(str(run_folder / "caption_rejects")).count_rows()
    from datasets import load_dataset  # the card's configs (what the Hub reads): the captions by default

    ds = load_dataset(str(tmp_path / "elsewhere" / "demo"), split="train", cache_dir=str(tmp_path / "hf-configs"))
    assert ds.num_rows == len(ran["largefine"])


def _assert_summary_lists_rejects(root: Path, summary: dict, stages: tuple[str, ...]) -> None:
    """The summary lists each non-pool stage's rejects once, counted as in its rejects artifact
    (read here, independently of the summary); each stage of ``stages`` has some."""
    expected: dict[str, int] = {}
    for name, stage in (("tier12_rejects", "qa-tiers"), ("adv_rejects", "adv-tier"),
                        ("select_rejects", "select-images"), ("template_rejects", "template-gallery")):
        for row in Artifact(str(root / name)).rows(["reason"]):
            expected[f"{stage}:{row['reason']}"] = expected.get(f"{stage}:{row['reason']}", 0) + 1
    assert all(any(k.startswith(f"{stage}:") for k in expected) for stage in stages), (stages, expected)
    listed = {k: v for k, v in summary["rejected"].items() if not k.startswith(("ingest:", "denoise:"))}
    assert listed == expected
    assert sum(summary["rejected"].values()) - sum(expected.values()) == summary["total_rejected"]
    markdown = summary_markdown(summary)
    assert all(f"| {key} | {count} |" in markdown for key, count in expected.items())


def test_summary_lists_every_stages_reject_reasons(offline_run: tuple[str, dict, dict]) -> None:
    """caption, template and selection rejects appear next to the denoise ones, each once.
    Which caption tiers SmolLM2 fails here depends on its decoded tokens (thread count, measured batch
    sizes), so this run is only required to have selection rejects (6 of 96 images are chosen); the
    transformers run below, whose random weights fail every tier, requires the tiers' rejects."""
    out, summary, _ = offline_run
    _assert_summary_lists_rejects(Path(out, "build-largefine", "demo"), summary, ("select-images",))


def test_a_missing_concurrency_limit_is_reported_once_per_run(run_logs: list[str],
                                                               offline_run: tuple[str, dict, dict]) -> None:
    """Prefect warns once per shard when the `gpu` limit does not exist (34 times in a
    demo build); the run says it once, and other warnings still reach the log."""
    assert not any("do not exist - skipping acquisition" in m for m in run_logs)
    assert sum(m.startswith("WARNING concurrency limit 'gpu' does not exist") for m in run_logs) == 1, run_logs


class _HoldsBack:
    """The run's generator, except that it does not answer about one image (a timeout each try)."""

    def __init__(self, generator: object, image_id: str) -> None:
        self.generator, self.image_id = generator, image_id
        self.model_id = generator.model_id

    def generate(self, requests: list) -> list:
        from models.backends.interfaces import GenerationResult

        asked = [r for r in requests if not r.request_id.startswith(self.image_id)]
        answered = self.generator.generate(asked) if asked else []
        by_id = {r.request_id: r for r in answered}
        return [by_id.get(r.request_id) or GenerationResult(r.request_id, "", [], self.model_id,
                                                            error="timeout: no answer within the limit")
                for r in requests]


def test_rerun_skips_a_lost_shard_is_redone_alone_and_a_timeout_is_retried(
        offline_run: tuple[str, dict, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain rerun skips; a shard lost in a kill is redone alone; an image whose generator did not
    answer in that redo (a ``timeout`` after the retries) is asked again by ``retry_rejects`` alone:
    the other shard's files and the other images' rows of its shard stay as they were."""
    from rde.largefine import tiered_captions

    out, first, overrides = offline_run
    again = build_largefine(profile="demo", output_root=out, overrides=overrides)
    assert all(s["skipped"] for s in again["stages"])
    root = Path(out, "build-largefine", "demo")
    tiers = root / "tier12_captions"
    (tiers / "_manifest.json").unlink()  # as if killed before the stage finished
    (tiers / "part-00001.parquet").unlink()
    held = Artifact(str(root / "neighbours")).read_shard(1, ["image_id"]).column("image_id")[0].as_py()
    real = tiered_captions.generate_with_retries
    monkeypatch.setattr(tiered_captions, "generate_with_retries",
                        lambda generator, *a, **k: real(_HoldsBack(generator, held), *a, **k))
    third = build_largefine(profile="demo", output_root=out, overrides=overrides, until="tiers")
    stages = _stages(third)
    assert not stages["qa-tiers"]["skipped"] and stages["qa-tiers"]["shards_reused"] == 1
    # the redone shard is new generator output (llama.cpp's prompt cache makes reruns differ in the last
    # digits), so later stages rerun; what must hold is the accounting, not equal texts
    assert stages["qa-tiers"]["input"] == _stages(first)["qa-tiers"]["input"]
    timeouts = [r for r in Artifact(str(root / "tier12_rejects")).rows(["image_id", "reason"])
                if r["reason"] == "timeout"]
    assert timeouts == [{"image_id": held, "reason": "timeout"}] * 2  # base and inter

    monkeypatch.setattr(tiered_captions, "generate_with_retries", real)  # the generator answers again
    kept = {i: s.sha256 for i, s in enumerate(Artifact(str(tiers)).manifest().shards)}
    others = [r for r in Artifact(str(tiers)).read_shard(1).to_pylist() if r["image_id"] != held]
    fourth = build_largefine(profile="demo", output_root=out, overrides=overrides, retry_rejects=True)
    assert fourth["retried"]["qa-tiers"] == {"retried": 1, "recovered": 1}
    assert "adv-tier" not in fourth["retried"]  # its held-image rows were missing_tier_input, not transient
    assert Artifact(str(tiers)).manifest().shards[0].sha256 == kept[0]  # the shard without a timeout is kept
    redone = Artifact(str(tiers)).read_shard(1).to_pylist()
    assert [r for r in redone if r["image_id"] != held] == others  # and so are the other images' rows
    rejected = [r["stage"].removeprefix("tier-") for r in Artifact(str(root / "tier12_rejects")).rows(
        ["image_id", "stage"]) if r["image_id"] == held]
    # the held image now ends each tier once, as a caption or a reject the gates gave (not a timeout)
    assert sorted([r["tier"] for r in redone if r["image_id"] == held] + rejected) == ["base", "inter"]
    assert not [r for r in Artifact(str(root / "tier12_rejects")).rows(["reason"]) if r["reason"] == "timeout"]
    assert Artifact(str(root / "largefine")).count_rows() + Artifact(str(root / "caption_rejects")).count_rows() \
        == 3 * Artifact(str(root / "neighbours")).count_rows()


def test_webdataset_export_reads_back_with_the_webdataset_loader(offline_run: tuple[str, dict, dict],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``largefine.webdataset`` on: only the export stage runs (the rest is reused), and the
    ``webdataset`` library's own pipeline reads back every captioned image with its texts."""
    import io

    import webdataset as wds
    from PIL import Image

    out, _, overrides = offline_run
    summary = build_largefine(profile="demo", output_root=out,
                              overrides={**overrides, "largefine": {**LARGEFINE, "webdataset": True}})
    stages = _stages(summary)
    assert not stages["export-webdataset"]["skipped"] and stages["export-largefine"]["skipped"]
    captions = Artifact(summary["artifacts"]["largefine"]["url"]).to_pandas()
    expected = {image_id: dict(zip(rows.tier, rows.text, strict=True))
                for image_id, rows in captions.groupby("image_id")}
    accepted = Artifact(summary["artifacts"]["accepted"]["url"]).to_pandas().set_index("image_id")
    tars = sorted(str(p) for p in (Path(out) / "build-largefine" / "demo" / "largefine_wds").glob("*.tar"))
    assert len(tars) == len(Artifact(summary["artifacts"]["largefine"]["url"]).manifest().shards)
    seen = {}
    for sample in wds.WebDataset(tars, shardshuffle=False).decode("pil"):
        meta = sample["json"]
        image = sample.get("jpg") or sample.get("png")
        source = Image.open(io.BytesIO(accepted.loc[meta["image_id"], "image_bytes"]))
        assert image.size == source.size and meta["lineage"]["source"] == accepted.loc[meta["image_id"], "source"]
        seen[meta["image_id"]] = meta["texts"]
    assert seen == expected  # every captioned image once, with each of its tiers' texts
    index = Artifact(summary["artifacts"]["largefine_wds"]["url"]).to_pandas()
    assert sorted(index.image_id) == sorted(expected) and stages["export-webdataset"]["accepted"] == len(expected)
    again = build_largefine(profile="demo", output_root=out,
                            overrides={**overrides, "largefine": {**LARGEFINE, "webdataset": True}})
    assert all(s["skipped"] for s in again["stages"])
    root = Path(out, "build-largefine", "demo")
    card = (root / "README.md").read_text()
    code = card.split("largefine_wds/` (one sample", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(root)  # the card's snippet reads relative to its own folder
    scope: dict = {}
    exec(code, scope)
    assert scope["texts"] in expected.values() and scope["image"].size[0] > 0
