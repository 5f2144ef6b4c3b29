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


def cgds_peak(root: str, n: int) -> tuple[int, int]:
    """Peak Python memory (tracemalloc) of CGDS on an n-image pool, and its gallery size. Run in a
    fresh process (``_measured``): tracemalloc in a worker that other tests left threads in
    (Prefect, OpenMP) crashed once, and a fresh process measures only this stage."""
    folder = Path(root) / f"n{n}"
    _accepted(folder / "build-secmm" / "demo" / "accepted", n)
    ModelRegistry.image_embedder = lambda self: MeanEmbedder()  # type: ignore[method-assign]
    profile = load_profile("demo", {"sampling": {"clusters_per_domain": 3, "min_per_cluster": 2,
                                                 "max_per_cluster": 8}})
    stage = secmm_tasks.Cgds()
    run = StageRun(stage, RunContext(profile, "build-secmm", str(folder)))
    stage.lineage(run)
    tracemalloc.start()
    try:
        work = stage.run(run)
        gallery = sum(t["gallery"].num_rows for t in work.shards)  # consumed as the runner does: one at a time
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, gallery


def _measured(root: Path, sizes: list[int]) -> list[tuple[int, int]]:
    """``cgds_peak`` of each size, in order, in one fresh interpreter (the first size warms it up)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_streaming_memory import cgds_peak; "
            f"print(json.dumps([cgds_peak({str(root)!r}, n) for n in {sizes!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def test_cgds_memory_does_not_grow_with_the_pool(tmp_path: Path) -> None:
    """48 vs 192 images (~30 KB each, 16 per shard): holding every image's bytes takes ~4.6 MB
    more at 192 (measured: 3.0 → 7.6 MB peak when the gallery step read all rows with their
    bytes); streaming holds one shard's (~0.5 MB) plus metadata (measured 1.54 MB at both sizes).
    The first, 16-image run takes the k-means imports and first-use allocations."""
    _, (small, g_small), (large, g_large) = _measured(tmp_path, [16, 48, 192])
    assert g_small > 0 and g_large > 0
    per_image = len(_jpeg(0))
    assert large - small < 40 * per_image, (small, large, per_image)  # 144 more images: < 40 images' bytes
