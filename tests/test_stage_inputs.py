"""Stages whose input is counted apart from the rows they write, so their balance check can fail:
the benchmark export (the candidates artifact's manifest against the qrels rows written) and the
caption pool on a caption file (the captions the file lists against the rows made of them). Each
test drops one row on purpose where the stage builds its rows and sees the stage's own counts
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

import tasks.secmm
from rde.profile import load_profile
from storage import Artifact, ArtifactWriter
from tasks.framework import accounting
from tasks.framework.context import RunContext
from tasks.framework.stage import StageRun


def _write(url: str, shards: list[pa.Table]) -> Artifact:
    """A complete artifact of these shards."""
    writer = ArtifactWriter(url, "test", shards[0].schema, "key")
    writer.begin()
    writer.finalize([writer.write_shard(i, t) for i, t in enumerate(shards)], code_version="test")
    return Artifact(url)


def _export_run(root: Path) -> tuple[tasks.secmm.export.Export, StageRun]:
    """The export stage over two queries, three gallery images and five candidates in two shards."""
    ctx = RunContext(load_profile("demo"), "export-check", str(root))
    _write(ctx.artifact_url("queries"), [pa.table({"query_id": ["q1", "q2"]})])
    _write(ctx.artifact_url("gallery"), [pa.table({"image_id": ["a", "b", "c"]})])
    _write(ctx.artifact_url("candidates"), [pa.table({"query_id": ["q1", "q1", "q2"], "image_id": ["a", "b", "c"]}),
                                            pa.table({"query_id": ["q2", "q2"], "image_id": ["a", "b"]})])
    stage = tasks.secmm.export.Export()
    return stage, StageRun(stage, ctx)


def test_export_counts_its_input_from_the_candidates_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage, run = _export_run(tmp_path)
    stats = stage.run(run).stats
    assert (stats["input_rows"], stats["accepted"], stats["verified"]) == (5, 5, 0)
    assert accounting.check_balance("export", stats)
    real = tasks.secmm.export.qrel_rows
    monkeypatch.setattr(tasks.secmm.export, "qrel_rows", lambda candidates, decisions: real(candidates, decisions)[:-1])
    with pytest.raises(accounting.AccountingError, match=r"export: 5 inputs counted, but 4 accepted \+ 0 rejected"):
        accounting.check_balance("export", stage.run(run).stats)


def _caption_pool_run(root: Path) -> tuple[tasks.secmm.caption_pool.CaptionPool, StageRun]:
    """The caption pool on a caption file of three captions (two of one person, one of another)."""
    file = root / "captions.json"
    file.write_text(json.dumps([{"id": "p1", "captions": ["a man in a red coat", "a man walking a dog"]},
                                {"file_path": "p2.jpg", "captions": ["a woman with a bag"], "domain": "pedestrian"}]))
    ctx = RunContext(load_profile("demo", {"queries": {"caption_file": str(file)}}), "caption-check", str(root))
    stage = tasks.secmm.caption_pool.CaptionPool()
    run = StageRun(stage, ctx)
    run.prepared = tasks.secmm.caption_pool.CaptionSource(None, None, str(file))  # what lineage() prepares
    return stage, run


def test_a_caption_file_counts_its_captions_apart_from_the_rows_made_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stage, run = _caption_pool_run(tmp_path)
    work = stage.run(run)
    assert (work.stats["input_rows"], work.stats["accepted"]) == (3, 3)
    assert accounting.check_balance("caption-pool", work.stats)
    assert next(iter(work.shards))["caption_pool"].column("image_id").to_pylist() == ["p1#0", "p1#1", "p2.jpg#0"]
    real = tasks.secmm.caption_pool.captions_from_file
    monkeypatch.setattr(tasks.secmm.caption_pool, "captions_from_file", lambda path, domain: real(path, domain)[1:])
    with pytest.raises(accounting.AccountingError, match=r"caption-pool: 3 inputs counted, but 2 accepted"):
        accounting.check_balance("caption-pool", stage.run(run).stats)


def test_count_equal_reads_one_column_across_shards(tmp_path: Path) -> None:
    art = _write(str(tmp_path / "a"), [pa.table({"kind": ["pair", "image", "pair"], "n": [1, 2, 3]}),
                                       pa.table({"kind": ["heldout", "pair"], "n": [4, 5]})])
    assert (art.count_equal("kind", "pair"), art.count_equal("kind", "heldout"), art.count_equal("kind", "x")) \
        == (3, 1, 0)
