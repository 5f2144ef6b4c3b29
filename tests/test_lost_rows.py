"""Each flow, with one row dropped on purpose inside a stage, fails naming the stage and the gap
(``AccountingError``) instead of finishing with a summary that looks fine. The stages count their
input themselves (files listed, (image, tier) captions asked for, clips listed), so the loss shows.
Rows lost between two stages (each of them balanced) leave the run unbalanced and ``rde`` exits 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from storage import Artifact, ArtifactWriter
from storage.hashing import sha256_json

pytestmark = pytest.mark.slow


def test_build_secmm_fails_when_ingest_drops_an_image(tmp_path: Path, small_pool_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.pool.ingest
    from flows.build_secmm import build_secmm

    real = tasks.pool.ingest.ingest_shard

    def drops_one(*args: Any, **kwargs: Any) -> tuple[pa.Table, pa.Table]:
        images, rejects = real(*args, **kwargs)
        return images.slice(0, max(images.num_rows - 1, 0)), rejects

    monkeypatch.setattr(tasks.pool.ingest, "ingest_shard", drops_one)
    # every shard loses one image: the first shard to finish names itself and its gap
    with pytest.raises(Exception, match=r"ingest shard \d: 16 inputs counted, but 15 accepted \+ 0 rejected = 15 "
                                        r"\(1 rows lost"):
        build_secmm(profile="demo", output_root=str(tmp_path), until="denoise",
                    overrides={"input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16}})
    assert not Artifact(str(tmp_path / "build-secmm" / "demo" / "images")).is_complete()


def test_build_largefine_fails_when_a_tier_caption_vanishes(tmp_path: Path, small_pool_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.build_largefine import build_largefine
    from rde.largefine.tiered_captions import TierCaptioner

    real = TierCaptioner._accept
    dropped: list[str] = []

    def loses_the_first(self: TierCaptioner, out: Any, item: Any, tier: str, *args: Any, **kwargs: Any) -> bool:
        if not dropped:  # neither a caption nor a rejected row: the bug the balance check exists for
            dropped.append(f"{item.image_id}:{tier}")
            return False
        return real(self, out, item, tier, *args, **kwargs)

    monkeypatch.setattr(TierCaptioner, "_accept", loses_the_first)
    with pytest.raises(Exception, match=r"qa-tiers shard \d+: 6 inputs counted, .*\(1 rows lost"):
        build_largefine(profile="demo", output_root=str(tmp_path), until="tiers", overrides={
            "input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16},
            "largefine": {"max_images": 6, "shard_size": 3, "templates": {"sample_captions": 4, "rounds": 1}}})
    assert dropped
    assert not Artifact(str(tmp_path / "build-largefine" / "demo" / "tier12_captions")).is_complete()


def _clip_set(folder: Path) -> str:
    """Six training and three test clips of the bundled clip set, written to ``folder``."""
    from entry.demo_clips import ClipParams, write_clip_set
    from storage.locations import project_root

    src = project_root() / "data" / "demo_clips"
    clips = Artifact(str(src / "clips")).rows()
    chosen = [c for c in clips if c["split"] == "train"][:6] + [c for c in clips if c["split"] == "test"][:3]
    frames = {i for c in chosen for i in c["frame_indices"]}
    write_clip_set([r for r in Artifact(str(src / "frames")).rows() if r["frame_index"] in frames], chosen,
                   str(folder), ClipParams(), "vtest.avi", fps=10.0)
    return str(folder)


def test_train_vedje_fails_when_a_clip_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rde.vedje.data
    from flows.train_vedje import train_vedje

    _clip_set(tmp_path / "clips")
    real = rde.vedje.data._clips

    def loses_the_last_clip(path: str) -> Any:
        items = real(path)
        last = len(items.item_ids) - 1  # drop the last clip and its queries, count nothing for it
        for name in ("item_ids", "groups", "splits", "frames"):
            getattr(items, name).pop()
        keep = [k for k, i in enumerate(items.query_items) if i != last]
        items.query_texts = [items.query_texts[k] for k in keep]
        items.query_items = [items.query_items[k] for k in keep]
        return items

    monkeypatch.setattr(rde.vedje.data, "_clips", loses_the_last_clip)
    with pytest.raises(Exception, match=r"vedje-features: 9 inputs counted, but 8 accepted \+ 0 rejected"):
        train_vedje(profile="demo", output_root=str(tmp_path / "out"),
                    until="features", overrides={"vedje": {"clips_path": str(tmp_path / "clips"), "epochs": 1}})


def _drop_rows(url: str, index: int, n: int) -> None:
    """Rewrite shard ``index`` of the complete artifact at ``url`` without its last ``n`` rows, and its
    manifest to match (rows, bytes, hash, fingerprint): still complete, with rows lost after the
    stage that wrote it balanced."""
    art = Artifact(url)
    manifest = art.manifest()
    table = art.read_shard(index)
    writer = ArtifactWriter(url, manifest.kind, table.schema, manifest.stage_key)
    manifest.shards[index] = writer.write_shard(index, table.slice(0, table.num_rows - n), art.shard_stats(index))
    manifest.total_rows = sum(s.rows for s in manifest.shards)
    manifest.fingerprint = sha256_json([s.sha256 for s in manifest.shards])
    Path(art.manifest_path).write_text(manifest.to_json())


def _printed_json(output: str) -> dict[str, Any]:
    """The summary ``--json`` printed: from the first line that is ``{`` to the next that is ``}``."""
    lines = output.splitlines()
    start = lines.index("{")
    return json.loads("\n".join(lines[start:lines.index("}", start) + 1]))


def test_rows_lost_between_measure_and_denoise_leave_the_run_unbalanced_and_rde_exits_2(
        tmp_path: Path, tiny_pool_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage balances its own rows, but three images vanish from ``images`` after measure and
    before denoise: the summary says where (denoise read 3 fewer than measure accepted), marks that
    stage, is not balanced, and ``rde`` prints it and exits 2 naming the gap."""
    from typer.testing import CliRunner

    import tasks.framework.runner
    from entry.cli import app

    real = tasks.framework.runner.run_stage

    def loses_three_images_before_denoise(ctx: Any, stage: Any) -> Any:
        if stage.name == "denoise":
            _drop_rows(ctx.artifact_url("images"), 1, 3)
        return real(ctx, stage)

    monkeypatch.setattr(tasks.framework.runner, "run_stage", loses_three_images_before_denoise)
    result = CliRunner().invoke(app, ["build-secmm", "--until", "denoise", "--input", tiny_pool_url, "--output",
                                      str(tmp_path), "--set", "ingest.shard_size=12", "--json"])
    assert result.exit_code == 2, result.output
    summary = _printed_json(result.stdout)
    stages = {s["stage"]: s for s in summary["stages"]}
    measured = stages["measure"]["accepted"]
    assert stages["denoise"]["input"] == measured - 3 and stages["ingest"]["accepted"] == measured
    assert [stages[name]["balanced"] for name in ("ingest", "measure", "denoise")] == [True, True, False]
    gap = f"denoise: {measured - 3} inputs, but measure accepted {measured} (3 rows lost between the two stages)"
    assert summary["balanced"] is False and summary["imbalance"][1:] == [gap]
    assert summary["imbalance"][0].endswith("(3 rows lost)")
    assert summary["accepted"] + summary["total_rejected"] == summary["inputs"] - 3
    said = " ".join(result.stderr.split())
    assert f"error: accounting mismatch: {summary['imbalance'][0]}; {gap}" in said


def test_train_vedje_fails_when_its_trainer_loses_a_training_query(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vedje-train counts its input from the ``vedje_queries`` artifact's training split, apart from
    the queries its loader hands the trainer: one of them dropped on the way fails the stage; with
    none dropped the two counts agree and the stage is checked."""
    from tiny_models import build_tiny_bert

    import rde.vedje.model_store
    from flows.train_vedje import train_vedje

    real = rde.vedje.model_store.tensors_from_tables

    def loses_a_training_query(frames: pa.Table, items: pa.Table, queries: pa.Table, *args: Any, **kwargs: Any
                               ) -> Any:
        first = queries.column("split").to_pylist().index("train")
        kept = pa.concat_tables([queries.slice(0, first), queries.slice(first + 1)])
        return real(frames, items, kept, *args, **kwargs)

    monkeypatch.setattr(rde.vedje.model_store, "tensors_from_tables", loses_a_training_query)
    bert = build_tiny_bert(tmp_path / "tiny-bert")
    vedje = {"clips_path": _clip_set(tmp_path / "clips"), "epochs": 1, "batch_size": 16, "train_candidates": 3,
             "warmup_steps": 2, "candidates": [4], "joint_encoder": {"backend": "bert", "model_id": str(bert),
                                                                     "options": {"layers": 2}}}
    with pytest.raises(Exception, match=r"vedje-train: \d+ inputs counted, but \d+ accepted \+ 0 rejected = \d+ "
                                        r"\(1 rows lost"):
        train_vedje(profile="demo", output_root=str(tmp_path / "out"), until="train", overrides={"vedje": vedje})
    assert not Artifact(str(tmp_path / "out" / "train-vedje" / "demo" / "vedje_log")).is_complete()
    monkeypatch.undo()
    summary = train_vedje(profile="demo", output_root=str(tmp_path / "out"), until="train", overrides={"vedje": vedje})
    features, trained = summary["stages"]
    assert features["skipped"] and not trained["skipped"] and trained["balanced"] is True
    queries = Artifact(str(tmp_path / "out" / "train-vedje" / "demo" / "vedje_queries")).rows(["split"])
    assert trained["input"] == trained["accepted"] == sum(q["split"] == "train" for q in queries) > 0
    assert summary["balanced"]
