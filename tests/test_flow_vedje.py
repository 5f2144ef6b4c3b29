"""End to end: train-vedje → index-cache → rerank on a slice of the bundled clip set (real frames,
real backbone and stage-1 expert, a tiny joint encoder built from config), cache lineage, reuse
after a joint-encoder-only update, and the clear error after a compressor change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import build_tiny_bert

from flows.index_cache import index_cache
from flows.rerank import rerank
from flows.train_vedje import train_vedje
from models.reranker.cache_store import CacheLineageError
from rde.demo_clips import ClipParams, write_clip_set
from rde.runtime import project_root
from storage import Artifact

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clip_slice(tmp_path_factory: pytest.TempPathFactory) -> str:
    """20 consecutive training clips, 3 gap clips and 8 test clips of the bundled set (~45 frames)."""
    src = project_root() / "data" / "demo_clips"
    clips = Artifact(str(src / "clips")).rows()
    by_split = {s: [c for c in clips if c["split"] == s] for s in ("train", "gap", "test")}
    chosen = by_split["train"][:20] + by_split["gap"][:3] + by_split["test"][:8]
    frames = {i for c in chosen for i in c["frame_indices"]}
    frame_rows = [r for r in Artifact(str(src / "frames")).rows() if r["frame_index"] in frames]
    out = tmp_path_factory.mktemp("clips") / "demo_clips"
    write_clip_set(frame_rows, chosen, str(out), ClipParams(), "vtest.avi")
    return str(out)


@pytest.fixture(scope="module")
def overrides(clip_slice: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    bert = build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    return {"vedje": {"clips_path": clip_slice, "joint_encoder": {"backend": "bert", "model_id": str(bert),
                                                        "options": {"layers": 2}},
                      "epochs": 2, "batch_size": 16, "train_candidates": 3, "warmup_steps": 2,
                      "candidates": [4, 8], "shard_size": 12}}


def test_train_index_rerank_end_to_end(tmp_path: Path, overrides: dict) -> None:
    out = str(tmp_path)
    summary = train_vedje(profile="demo", output_root=out, overrides=overrides)
    features, _trained = summary["stages"]
    assert features["input"] == 31 and features["accepted"] == 28 and features["rejected"] == 3
    assert summary["rejected"] == {"vedje-features:split_gap": 3}
    model_dir = Path(out, "train-vedje", "demo", "vedje_model")
    meta = json.loads((model_dir / "model.json").read_text())
    assert meta["shape"]["frames"] == 8 and meta["shape"]["tokens_per_frame"] == 4
    evaluation = Artifact(str(model_dir.parent / "vedje_evaluation")).rows()
    assert {r["precision"] for r in evaluation} == {"bf16", "fp8", "fp4"}
    assert {(r["ranking"], r["n_candidates"]) for r in evaluation} >= {("stage-1", 0), ("rerank", 4), ("rerank", 8)}
    terms = json.loads(Artifact(str(model_dir.parent / "vedje_log")).rows()[0]["terms"])
    assert set(terms) == {"vtm", "vtc", "mlm", "delta"}

    index_cache(profile="demo", output_root=out, overrides=overrides)
    cache = Artifact(str(Path(out, "index-cache", "demo", "cache")))
    assert cache.count_rows() == 28 and len(cache.shard_paths()) == 3
    assert set(cache.rows(["payload_bytes"])[0].values()) == {2 * 8 * 4 * 32}  # 2·T·M·d, BF16
    assert cache.manifest().config["cache_lineage"] == meta["cache_lineage"]

    rerank(profile="demo", output_root=out, overrides=overrides)
    ranked = Artifact(str(Path(out, "rerank", "demo", "reranked"))).rows()
    test_queries = {r["query_id"] for r in ranked}
    assert len(ranked) == 8 * len(test_queries) and all(r["relevant"] is not None for r in ranked)
    flow_eval = {(r["ranking"], r["metric"]): r["value"] for r in Artifact(
        str(Path(out, "rerank", "demo", "rerank_evaluation"))).rows() if r["n_candidates"] == 8}
    train_eval = {(r["ranking"], r["metric"]): r["value"] for r in evaluation
                  if r["precision"] == "bf16" and r["n_candidates"] in (0, 8)}
    # the stored caches rerank like the in-memory evaluation (same frames, backbone, compressor)
    for key, value in flow_eval.items():
        assert value == pytest.approx(train_eval[key], abs=100 / len(test_queries) + 1e-9), key

    free = rerank(profile="demo", output_root=out, overrides=overrides, queries=["a person walks to the left"])
    rows = Artifact(free["artifacts"]["rerank.reranked"]["url"]).rows()
    assert len(rows) == 8 and {r["relevant"] for r in rows} == {None} and sorted(r["rank"] for r in rows) == list(
        range(8))

    # a joint-encoder-only update keeps the compressor, so the caches stay valid without re-indexing
    only_joint = {"vedje": {**overrides["vedje"], "train_compressor": False, "lr_peak": 2e-4}}
    train_vedje(profile="demo", output_root=out, overrides=only_joint)
    assert json.loads((model_dir / "model.json").read_text())["cache_lineage"] == meta["cache_lineage"]
    rerank(profile="demo", output_root=out, overrides=only_joint)

    # retraining the compressor invalidates the caches: a clear error until index-cache runs again
    changed = {"vedje": {**overrides["vedje"], "lr_peak": 5e-4}}
    train_vedje(profile="demo", output_root=out, overrides=changed)
    with pytest.raises(CacheLineageError, match=r"compressor weights.*rde index-cache"):
        rerank(profile="demo", output_root=out, overrides=changed)


def test_rerank_before_training_is_a_clear_error(tmp_path: Path, overrides: dict) -> None:
    with pytest.raises(FileNotFoundError, match="run `rde train-vedje"):
        index_cache(profile="demo", output_root=str(tmp_path), overrides=overrides)


def test_cli_rerank_without_a_model_exits_with_a_message(tmp_path: Path, overrides: dict) -> None:
    from typer.testing import CliRunner

    from rde.cli import app

    result = CliRunner().invoke(app, ["rerank", "--output", str(tmp_path), "--set",
                                      f"vedje.clips_path={overrides['vedje']['clips_path']}"])
    assert result.exit_code == 2 and "run `rde train-vedje" in result.output
    assert "Traceback" not in result.output
