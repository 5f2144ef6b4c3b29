"""Each flow, with one row dropped on purpose inside a stage, fails naming the stage and the gap
(``AccountingError``) instead of finishing with a summary that looks fine. The stages count their
input themselves (files listed, (image, tier) captions asked for, clips listed), so the loss shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from storage import Artifact

pytestmark = pytest.mark.slow


def test_build_secmm_fails_when_ingest_drops_an_image(tmp_path: Path, small_pool_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.ingest
    from flows.build_secmm import build_secmm

    real = tasks.ingest.ingest_shard

    def drops_one(*args: Any, **kwargs: Any) -> tuple[pa.Table, pa.Table]:
        images, rejects = real(*args, **kwargs)
        return images.slice(0, max(images.num_rows - 1, 0)), rejects

    monkeypatch.setattr(tasks.ingest, "ingest_shard", drops_one)
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


def test_train_vedje_fails_when_a_clip_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rde.vedje.data
    from flows.train_vedje import train_vedje
    from rde.entry.demo_clips import ClipParams, write_clip_set
    from storage.locations import project_root

    src = project_root() / "data" / "demo_clips"
    clips = Artifact(str(src / "clips")).rows()
    chosen = [c for c in clips if c["split"] == "train"][:6] + [c for c in clips if c["split"] == "test"][:3]
    frames = {i for c in chosen for i in c["frame_indices"]}
    write_clip_set([r for r in Artifact(str(src / "frames")).rows() if r["frame_index"] in frames], chosen,
                   str(tmp_path / "clips"), ClipParams(), "vtest.avi", fps=10.0)
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
