"""Stages that need the whole pool (CGDS's k-means and draw) work on embeddings; image bytes are
read one shard at a time, so the Python memory a stage holds does not grow with the pool."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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


class BytesReads:
    """A counting fake around the artifact readers: the image bytes each read hands out at once
    (``read_shard`` and ``iter_shards`` return one shard; ``rows`` and ``to_pandas`` a whole
    artifact), so a test can see the largest batch of bytes a stage ever held from one read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[tuple[str, int]] = []  # (reader, bytes of image_bytes values)
        real_read, real_rows = Artifact.read_shard, Artifact.rows

        def read_shard(art: Artifact, index: int, columns=None) -> pa.Table:
            table = real_read(art, index, columns)
            self._count("read_shard", table)
            return table

        def rows(art: Artifact, columns=None) -> list[dict]:
            out = real_rows(art, columns)
            if out and "image_bytes" in out[0]:
                self.batches.append(("rows", sum(len(r["image_bytes"]) for r in out)))
            return out

        monkeypatch.setattr(Artifact, "read_shard", read_shard)  # iter_shards reads through it
        monkeypatch.setattr(Artifact, "rows", rows)

    def _count(self, reader: str, table: pa.Table) -> None:
        if "image_bytes" in table.column_names:
            self.batches.append((reader, int(pc.sum(pc.binary_length(
                table.column("image_bytes"))).as_py() or 0)))

    @property
    def largest(self) -> int:
        return max((n for _, n in self.batches), default=0)


def _cgds_reads(tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch) -> tuple[BytesReads, int, int]:
    """CGDS on an n-image pool with the counting readers; (reads, gallery size, pool bytes)."""
    folder = tmp_path / f"n{n}"
    pool = _accepted(folder / "build-secmm" / "demo" / "accepted", n)
    total = sum(len(r["image_bytes"]) for r in pool.rows(["image_bytes"]))
    monkeypatch.setattr(ModelRegistry, "image_embedder", lambda self: MeanEmbedder())
    profile = load_profile("demo", {"sampling": {"clusters_per_domain": 3, "min_per_cluster": 2,
                                                 "max_per_cluster": 8}})
    stage = secmm_tasks.Cgds()
    run = StageRun(stage, RunContext(profile, "build-secmm", str(folder)))
    stage.lineage(run)
    with monkeypatch.context() as patch:
        reads = BytesReads(patch)
        work = stage.run(run)
        gallery = sum(t["gallery"].num_rows for t in work.shards)  # consumed as the runner does: one at a time
    return reads, gallery, total


def test_cgds_never_holds_more_than_one_shard_of_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """48 and 192 images, 16 per shard: every read CGDS makes hands out at most one shard of image
    bytes, so the largest batch is the same at both sizes, a quarter of the small pool's bytes at
    most. (Measured once with tracemalloc: peak 1.54 MB at both sizes, 3.0 → 7.6 MB when the
    gallery step read every row with its bytes; tracemalloc itself crashed suite runs twice, so the
    test counts reads instead.) Fails when any step reads the pool's bytes whole."""
    small, g_small, bytes_small = _cgds_reads(tmp_path, 48, monkeypatch)
    large, g_large, bytes_large = _cgds_reads(tmp_path, 192, monkeypatch)
    assert g_small > 0 and g_large > 0 and bytes_large > 3 * bytes_small
    assert all(reader == "read_shard" for reader, _ in small.batches + large.batches), large.batches
    assert large.largest <= 1.25 * small.largest and large.largest <= bytes_small / 2, (small.largest, large.largest)
