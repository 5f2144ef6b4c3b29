"""The stage tables: ``flows.catalog`` reads them from the stages' declarations, the pipeline pages
hold them (written by scripts/gen_reference.py between markers, checked by ``--check``) and
``rde describe PIPELINE`` prints them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import typer.main
from reference_script import load_generator
from typer.testing import CliRunner

from entry.cli import app
from flows import catalog
from rde.common.reasons import meanings

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


gen = load_generator()


def _section(page: str, pipeline: str) -> str:
    text = (gen.PIPELINES_DIR / page).read_text(encoding="utf-8")
    begin, end = text.index(gen.begin_marker(pipeline)), text.index(gen.end_marker(pipeline))
    return text[begin:end]


def _row(section: str, stage: str) -> str:
    found = [line for line in section.splitlines() if line.startswith("| ") and f"| `{stage}`" in line]
    assert len(found) == 1, (stage, found)
    return found[0]


def test_the_pipeline_pages_hold_the_generated_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert gen.main(["--check"]) == 0, capsys.readouterr().err
    pages = gen.generate()
    for page in gen.PIPELINE_PAGES:
        path = gen.PIPELINES_DIR / page
        assert pages[path] == path.read_text(encoding="utf-8"), page


def test_caption_pools_declared_track_facts_is_in_the_build_secmm_table() -> None:
    stage = next(s for s in catalog.pipeline("build-secmm").stages if s.name == "caption-pool")
    assert "track_facts" in stage.config
    assert "[`track_facts`](../reference/profile.md#track_facts)" in _row(_section("build-secmm.md", "build-secmm"),
                                                                          "caption-pool")


def test_every_declared_read_write_and_config_entry_is_in_its_row() -> None:
    for page, pipelines in gen.PIPELINE_PAGES.items():
        for name in pipelines:
            section = _section(page, name)
            for stage in catalog.pipeline(name).stages:
                row = _row(section, stage.name)
                for entry in (*stage.reads, *stage.optional_reads, *(w.name for w in stage.writes), *stage.config):
                    assert f"`{entry}`" in row, (name, stage.name, entry)
                for code in catalog.stage_reasons(stage.name):
                    assert f"`{code}`" in row, (name, stage.name, code)


def test_a_page_without_the_markers_fails_naming_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    reference = tmp_path / "reference"  # the reference pages' copies: a rewrite touches only them
    shutil.copytree(gen.REFERENCE_DIR, reference)
    monkeypatch.setattr(gen, "REFERENCE_DIR", reference)
    (tmp_path / "reranker.md").write_text("# Reranker\n\nno table here\n", encoding="utf-8")
    monkeypatch.setattr(gen, "PIPELINES_DIR", tmp_path)
    monkeypatch.setattr(gen, "PIPELINE_PAGES", {"reranker.md": ("rerank",)})
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "reranker.md lacks the markers of the rerank stage table" in err and gen.begin_marker("rerank") in err
    # with the markers, the script fills them in and the check passes
    (tmp_path / "reranker.md").write_text(f"# Reranker\n\n{gen.begin_marker('rerank')}\n{gen.end_marker('rerank')}\n\n"
                                          "prose kept\n", encoding="utf-8")
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    written = (tmp_path / "reranker.md").read_text(encoding="utf-8")
    assert "| 1 | `rerank` | whole | cpu |" in written and written.endswith("prose kept\n")


def test_every_stage_the_reason_registry_names_is_a_stage_of_a_pipeline() -> None:
    stages = {s.name for name in catalog.pipeline_names() for s in catalog.pipeline(name).stages}
    for code, (names, _) in meanings().items():
        for part in names.split(","):
            bare = re.sub(r"\s*\(.*?\)\s*$", "", part.strip())
            resolved = catalog.REGISTRY_NAMES.get(bare, (bare,))
            assert set(resolved) <= stages, f"reason {code}: the registry names {part.strip()!r}, no stage"


def test_a_stage_that_writes_rejects_can_write_a_reason() -> None:
    for name in catalog.pipeline_names():
        for row in catalog.describe(name).rows:
            if row.rejects and not row.rejects_from_upstream:
                assert row.reasons, (name, row.name)


def test_the_static_pipelines_are_the_flows_own() -> None:
    from flows.run_shards import PIPELINE_MODULES

    for name, module in PIPELINE_MODULES.items():
        found = __import__(module, fromlist=["PIPELINE"]).PIPELINE
        if not callable(found):
            assert [s.name for s in catalog.pipeline(name).stages] == [s.name for s in found.stages]


def test_every_pipeline_is_a_command() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert set(catalog.pipeline_names()) <= set(commands)


@pytest.mark.parametrize("columns", [80, 200])
def test_rde_describe_prints_the_table(columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table on a wide terminal, a block per stage on a narrow one: every stage's name whole in both."""
    from entry.cli_base import console

    monkeypatch.setattr(console, "_width", columns)  # the terminal's width, as rich reads it at start
    result = runner.invoke(app, ["describe", "build-secmm"])
    assert result.exit_code == 0, result.output
    assert ("┃ stage" in result.output) == (columns >= 150)
    for name in ("build-secmm: 12 stages", "caption-pool", "near-duplicates", "per shard", "whole", "reject reasons"):
        assert name in result.output
    assert max(len(line) for line in result.output.splitlines()) <= columns
    as_json = runner.invoke(app, ["describe", "build-secmm", "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.output)
    pool = next(s for s in data["stages"] if s["name"] == "caption-pool")
    assert "track_facts" in pool["config"] and pool["rejects"] == "caption_pool_rejects"
    assert "fragment" in pool["reasons"]
    videos = next(s for s in data["stages"] if s["name"] == "videos")
    assert videos["when"] == 'input.kind == "video"' and videos["work"] == "per shard" and videos["device"] == "gpu"


def test_rde_describe_builds_the_pipelines_that_follow_the_run() -> None:
    for name, stage in (("train-saft", "train_<objective>"), ("evaluate", "score-<model>"), ("rerank", "rerank")):
        result = runner.invoke(app, ["describe", name, "--json"])
        assert result.exit_code == 0, result.output
        assert stage in [s["name"] for s in json.loads(result.output)["stages"]]


def test_rde_describe_an_unknown_pipeline_lists_the_known_ones() -> None:
    result = runner.invoke(app, ["describe", "build-secm"])
    assert result.exit_code == 2
    assert "no pipeline 'build-secm'" in result.output
    for name in catalog.pipeline_names():
        assert name in result.output
    assert "Traceback" not in result.output
