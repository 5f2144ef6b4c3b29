"""End to end: train-vedje → index-cache → rerank on a slice of the bundled clip set (real frames,
real backbone and stage-1 expert, a tiny joint encoder built from config), cache lineage, reuse
after a joint-encoder-only update, and the clear error after a compressor change."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from artifact_readers import assert_every_artifact_opens
from tiny_models import build_tiny_bert

from entry.demo_clips import ClipParams, write_clip_set
from flows.index_cache import index_cache
from flows.rerank import rerank
from flows.train_vedje import train_vedje
from models.reranker.cache_store import CacheLineageError
from rde.common import progress
from storage import Artifact
from storage.locations import project_root

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
    write_clip_set(frame_rows, chosen, str(out), ClipParams(), "vtest.avi", fps=10.0)
    return str(out)


@pytest.fixture(scope="module")
def overrides(clip_slice: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    bert = build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    return {"vedje": {"clips_path": clip_slice, "joint_encoder": {"backend": "bert", "model_id": str(bert),
                                                        "options": {"layers": 2}},
                      "epochs": 2, "batch_size": 16, "train_candidates": 3, "warmup_steps": 2,
                      "candidates": [4, 8], "shard_size": 12}}


class _Recorder:
    """A progress renderer that keeps, per stage line, the last (done, total, unit) that had a total,
    whether the line finished, and how many updates it got."""

    def __init__(self) -> None:
        self.stages: dict[str, list] = {}
        self.names: list[str] = []

    def start(self, snap: progress.Snapshot) -> int:
        self.names.append(snap.description)
        self.stages[snap.description] = [snap.done, snap.total, snap.unit, False, 0]
        return len(self.names)

    def update(self, handle: int, snap: progress.Snapshot) -> None:
        line = self.stages[self.names[handle - 1]]
        if snap.total is not None:
            line[:3] = [snap.done, snap.total, snap.unit]
        line[4] += 1

    def stop(self, handle: int, snap: progress.Snapshot) -> None:
        self.stages[self.names[handle - 1]][3] = True


# The flow reranks from the stored caches; train-vedje's in-memory evaluation computes its own, from
# the fp16 backbone features its features stage keeps (index-cache recomputes them per shard) and in
# other batch shapes, so about 1 % of the BF16 cache values lie one step apart, and its stage-1
# similarities come from other encoder batches. Measured: the two sides' scores differ by at most
# 1.5e-7 (stage 1: 1.2e-7); another CPU's kernels round otherwise, by as little. But the tiny joint
# encoder's scores of one query lie within ~1e-6 of each other, so where the relevant item is that
# close to the K-th place, either side of it is right. SCORE_EPS: ~7 × the measured difference.
SCORE_EPS = 1e-6


def _ambiguous_queries(ranked: list[dict], column: str, k: int, eps: float = SCORE_EPS) -> int:
    """Queries whose relevant item could fall on either side of rank ``k`` (in or out of R@k) if
    each of their ``column`` scores moved by up to ``eps``."""
    by_query: dict[int, list[dict]] = {}
    for row in ranked:
        by_query.setdefault(row["query_id"], []).append(row)
    count = 0
    for rows in by_query.values():
        relevant = next(r[column] for r in rows if r["relevant"])
        others = [r[column] for r in rows if not r["relevant"]]
        surely_above = sum(s > relevant + 2 * eps for s in others)
        maybe_above = sum(s > relevant - 2 * eps for s in others)
        count += surely_above < k <= maybe_above
    return count


def _sets(tree: dict, prefix: str = "") -> list[str]:
    """Nested overrides as ``--set key.path=value`` arguments."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _sets(value, f"{prefix}{key}.")
        else:
            out += ["--set", f"{prefix}{key}={json.dumps(value)}"]
    return out


def test_train_index_rerank_end_to_end(tmp_path: Path, overrides: dict) -> None:
    out = str(tmp_path)
    shown = _Recorder()
    with progress.install(shown):
        summary = train_vedje(profile="demo", output_root=out, overrides=overrides)
    features, _trained = summary["stages"]
    assert features["input"] == 31 and features["accepted"] == 28 and features["rejected"] == 3
    assert summary["rejected"] == {"vedje-features:split_gap": 3}
    assert summary["splits"] == {"train": 20, "test": 8} and summary["inputs"] == 31 and summary["balanced"]
    frames = shown.stages["vedje-features"]
    assert frames[2] == "frames" and frames[0] == frames[1] > 0 and frames[3]  # all frames, then finished
    steps = shown.stages["vedje-train"]
    assert steps[2] == "steps" and steps[0] == steps[1] > 0 and steps[1] % 2 == 0 and steps[3]  # 2 epochs
    assert steps[4] >= steps[1]  # it advanced step by step
    model_dir = Path(out, "train-vedje", "demo", "vedje_model")
    meta = json.loads((model_dir / "model.json").read_text())
    assert meta["shape"]["frames"] == 8 and meta["shape"]["tokens_per_frame"] == 4
    evaluation = Artifact(str(model_dir.parent / "vedje_evaluation")).rows()
    assert {r["precision"] for r in evaluation} == {"bf16", "fp8", "fp4"}
    assert {(r["ranking"], r["n_candidates"]) for r in evaluation} >= {("stage-1", 0), ("rerank", 4), ("rerank", 8)}
    terms = json.loads(Artifact(str(model_dir.parent / "vedje_log")).rows()[0]["terms"])
    assert set(terms) == {"vtm", "vtc", "mlm", "delta"}

    with progress.install(shown):
        index_cache(profile="demo", output_root=out, overrides=overrides)
    assert shown.stages["index-cache"][:4] == [3, 3, "shards", True]  # one line for 3 shard tasks
    cache = Artifact(str(Path(out, "index-cache", "demo", "cache")))
    assert cache.count_rows() == 28 and len(cache.shard_paths()) == 3
    assert {r["payload_bytes"] for r in cache.rows(["payload_bytes"])} == {2 * 8 * 4 * 32}  # 2·T·M·d, BF16, every row
    assert cache.manifest().config["cache_lineage"] == meta["cache_lineage"]

    with progress.install(shown):
        rerank(profile="demo", output_root=out, overrides=overrides)
    assert shown.stages["rerank"][0] == shown.stages["rerank"][1] > 0 and shown.stages["rerank"][3]
    ranked = Artifact(str(Path(out, "rerank", "demo", "reranked"))).rows()
    test_queries = {r["query_id"] for r in ranked}
    assert len(ranked) == 8 * len(test_queries) and all(r["relevant"] is not None for r in ranked)
    flow_eval = {(r["ranking"], r["metric"]): r["value"] for r in Artifact(
        str(Path(out, "rerank", "demo", "rerank_evaluation"))).rows() if r["n_candidates"] == 8}
    train_eval = {(r["ranking"], r["metric"]): r["value"] for r in evaluation
                  if r["precision"] == "bf16" and r["n_candidates"] in (0, 8)}
    # the stored caches rerank like the in-memory evaluation (same frames, backbone, compressor), but
    # for the queries a score difference of SCORE_EPS could move across the cut (see there)
    # one relevant item per query (every test item is a candidate, the query's own among them)
    assert sum(r["relevant"] for r in ranked) == len(test_queries)
    for (ranking, metric), value in flow_eval.items():
        column = "score" if ranking == "rerank" else "stage1_score"
        either_way = _ambiguous_queries(ranked, column, int(metric.removeprefix("R@")))
        assert value == pytest.approx(train_eval[(ranking, metric)], abs=100 * either_way / len(test_queries) + 1e-9), (
            ranking, metric, either_way)

    # every artifact of the three flows opens with pandas, pyarrow and datasets
    opened = {p.parent.parent.name for p in assert_every_artifact_opens(out, tmp_path / "hf-cache")}
    assert opened == {"train-vedje", "index-cache", "rerank"}

    free = rerank(profile="demo", output_root=out, overrides=overrides, queries=["a person walks to the left"])
    rows = Artifact(free["artifacts"]["reranked"]["url"]).rows()
    assert len(rows) == 8 and {r["relevant"] for r in rows} == {None} and sorted(r["rank"] for r in rows) == list(
        range(8))

    # the command prints the ranked list (a table, or JSON), and no progress outside a terminal
    from typer.testing import CliRunner

    from entry.cli import app

    args = ["rerank", "--query", "a person walks to the left", "--top", "3", "--output", out, *_sets(overrides)]
    printed = CliRunner().invoke(app, args)
    assert printed.exit_code == 0, printed.output
    best = sorted(rows, key=lambda r: r["rank"])[:3]
    lines = [line for line in printed.stdout.splitlines() if any(r["item_id"] in line for r in best)]
    assert len(lines) == 3 and all(r["item_id"] in line for r, line in zip(best, lines, strict=True))
    assert "stage-1 rank" in printed.stdout and re.search(r"\d+\.\d–\d+\.\d s", lines[0])
    assert not re.search(r"\d+/\d+ (frames|steps|shards|queries)", printed.output)
    as_json = CliRunner().invoke(app, [*args, "--json"])
    results = json.loads(as_json.stdout[as_json.stdout.index("{"):])["results"]
    assert [r["query"] for r in results] == ["a person walks to the left"]
    top = results[0]["results"]
    assert [r["rank"] for r in top] == [1, 2, 3] and [r["item_id"] for r in top] == [r["item_id"] for r in best]
    assert [r["stage1_rank"] for r in top] == [r["stage1_rank"] + 1 for r in best]
    assert top[0]["score"] >= top[1]["score"] >= top[2]["score"] and top[0]["span"]["end_s"] > top[0]["span"]["start_s"]

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

    from entry.cli import app

    result = CliRunner().invoke(app, ["rerank", "--output", str(tmp_path), "--set",
                                      f"vedje.clips_path={overrides['vedje']['clips_path']}"])
    assert result.exit_code == 2 and "run `rde train-vedje" in result.output
    assert "Traceback" not in result.output


def test_index_cache_and_rerank_fail_when_they_lose_a_row(tmp_path: Path, overrides: dict,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One row dropped on purpose in each flow: a cache row that is never written, a query whose
    scoring returns nothing. Each run fails naming the stage instead of finishing short."""
    import rde.vedje.reranking
    import tasks.vedje.index_cache

    out = str(tmp_path)
    train_vedje(profile="demo", output_root=out, overrides=overrides)
    real_rows, real_scores = tasks.vedje.index_cache.cache_rows, rde.vedje.reranking.joint_scores
    monkeypatch.setattr(tasks.vedje.index_cache, "cache_rows", lambda *a, **k: real_rows(*a, **k).slice(1))
    with pytest.raises(Exception, match=r"index-cache shard \d+: 12 inputs counted, but 11 accepted"):
        index_cache(profile="demo", output_root=out, overrides=overrides)
    monkeypatch.setattr(tasks.vedje.index_cache, "cache_rows", real_rows)
    index_cache(profile="demo", output_root=out, overrides=overrides)
    calls: list[int] = []

    def nothing_for_the_first_query(*args, **kwargs):
        calls.append(1)
        scores = real_scores(*args, **kwargs)
        return scores[:0] if len(calls) == 1 else scores

    monkeypatch.setattr(rde.vedje.reranking, "joint_scores", nothing_for_the_first_query)
    with pytest.raises(Exception, match=r"rerank: \d+ inputs counted, but \d+ accepted .*\(1 rows lost"):
        rerank(profile="demo", output_root=out, overrides=overrides)
