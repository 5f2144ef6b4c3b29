"""Stages that need the whole pool (CGDS's k-means and draw) work on embeddings; image bytes are
read one shard at a time, so the Python memory a stage holds does not grow with the pool."""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from models.backends.registry import ModelRegistry
from rde.common.embedding_cache import EmbeddingCache
from rde.common.image_decoding import decoded_images
from rde.common.profiles import load_profile
from storage import Artifact, ArtifactWriter
from storage.hashing import sha256_bytes
from storage.schemas import ACCEPTED_IMAGES
from tasks import secmm as secmm_tasks
from tasks.context import RunContext
from tasks.stage import StageRun

SHARD = 16


class MeanEmbedder:
    """A 3-d embedding (the channel means): real decoding, no model, deterministic."""

    model_id, preprocessing, dim = "channel-means", "none", 3

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        self.calls += len(images)
        return np.stack([im.reshape(-1, 3).mean(0) / 255.0 for im in images]).astype(np.float32)


def _jpeg(seed: int, side: int = 160) -> bytes:
    """A noise JPEG of ~30 KB (noise does not compress: memory use is visible)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _accepted(folder: Path, n: int) -> Artifact:
    """An ``accepted`` artifact of n noise images in shards of ``SHARD``, two domains."""
    writer = ArtifactWriter(str(folder), "accepted_images", ACCEPTED_IMAGES, "test")
    writer.begin()
    shards = []
    for index, start in enumerate(range(0, n, SHARD)):
        rows = []
        for i in range(start, min(n, start + SHARD)):
            data = _jpeg(i)
            rows.append({"input_id": f"in-{i}", "image_id": sha256_bytes(data), "source": f"s{i}",
                         "domain": "pedestrian" if i % 4 else "vehicle", "identity": f"p{i // 3}", "width": 160,
                         "height": 160, "source_mode": "RGB", "image_format": "JPEG", "exif_orientation": None,
                         "source_meta": None, "image_bytes": data, "laplacian_variance": 500.0,
                         "target_count": 1, "target_scores": [0.9], "target_boxes": [[0, 0, 1, 1]]})
        shards.append(writer.write_shard(index, pa.Table.from_pylist(rows, schema=ACCEPTED_IMAGES)))
    writer.finalize(shards, code_version="test")
    return Artifact(str(folder))


def test_embed_artifact_embeds_each_image_once_and_reads_bytes_only_of_shards_with_a_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    art = _accepted(tmp_path / "accepted", 40)
    emb = MeanEmbedder()
    cache = EmbeddingCache(str(tmp_path), emb)
    vehicles = lambda r: r["domain"] == "vehicle"  # noqa: E731
    rows, vecs = cache.embed_artifact(art, ["image_id", "domain"], keep=vehicles)
    every = art.rows(["image_id", "domain", "image_bytes"])
    wanted = [r for r in every if r["domain"] == "vehicle"]
    assert [r["image_id"] for r in rows] == [r["image_id"] for r in wanted] and emb.calls == len(wanted) == 10
    direct = MeanEmbedder().embed([np.asarray(Image.open(io.BytesIO(r["image_bytes"])).convert("RGB")) for r in wanted])
    assert np.allclose(vecs, direct)
    reads: list[int] = []
    real = Artifact.read_shard

    def counting(self: Artifact, index: int, columns=None) -> pa.Table:
        if columns and "image_bytes" in columns:
            reads.append(index)
        return real(self, index, columns)

    monkeypatch.setattr(Artifact, "read_shard", counting)
    again_rows, again = cache.embed_artifact(art, ["image_id"])  # all 40: the 10 vehicles are cached
    assert emb.calls == 10 + 30 and np.allclose(again[[i for i, r in enumerate(every) if r["domain"] == "vehicle"]],
                                                vecs)
    assert sorted(set(reads)) == [0, 1, 2] and len(again_rows) == 40
    reads.clear()
    cache.embed_artifact(art, ["image_id"])
    assert reads == [] and emb.calls == 40  # all cached: no bytes read at all
    assert set(decoded_images(art, [every[3]["image_id"], every[35]["image_id"]])) == {every[3]["image_id"],
                                                                                      every[35]["image_id"]}


def _cgds_peak(tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Peak Python memory (tracemalloc) of CGDS on an n-image pool, and its gallery size."""
    root = tmp_path / f"n{n}"
    _accepted(root / "build-secmm" / "demo" / "accepted", n)
    monkeypatch.setattr(ModelRegistry, "image_embedder", lambda self: MeanEmbedder())
    profile = load_profile("demo", {"sampling": {"clusters_per_domain": 3, "min_per_cluster": 2,
                                                 "max_per_cluster": 8}})
    run = StageRun(secmm_tasks.Cgds(), RunContext(profile, "build-secmm", str(root)))
    stage = secmm_tasks.Cgds()
    stage.lineage(run)
    tracemalloc.start()
    try:
        work = stage.run(run)
        gallery = sum(t["gallery"].num_rows for t in work.shards)  # consumed as the runner does: one at a time
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, gallery


def test_cgds_memory_does_not_grow_with_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """48 vs 192 images (~30 KB each, 16 per shard): holding every image's bytes takes ~4.6 MB
    more at 192 (measured: 3.0 → 7.6 MB peak when the gallery step read all rows with their
    bytes); streaming holds one shard's (~0.5 MB) plus metadata (measured 1.54 MB at both sizes)."""
    _cgds_peak(tmp_path, 16, monkeypatch)  # first call: k-means imports and first-use allocations
    small, g_small = _cgds_peak(tmp_path, 48, monkeypatch)
    large, g_large = _cgds_peak(tmp_path, 192, monkeypatch)
    assert g_small > 0 and g_large > 0
    per_image = len(_jpeg(0))
    assert large - small < 40 * per_image, (small, large, per_image)  # 144 more images: < 40 images' bytes
