"""Stages that need the whole pool (CGDS's k-means and draw, the hard negatives) work on embeddings;
image bytes are read one shard at a time, and CGDS's large domains read their vectors one shard at a
time too, so the Python memory a stage holds does not grow with the pool."""

from __future__ import annotations

import functools
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from held_memory import MeanEmbedder
from PIL import Image

from models.backends.registry import ModelRegistry
from rde.common.embedding_cache import CachedVectors, EmbeddingCache
from rde.common.image_decoding import decoded_images
from rde.largefine.hard_negatives import hard_negative_neighbours
from rde.profile import Profile, load_profile
from rde.secmm import cgds
from storage import Artifact, ArtifactWriter
from storage.hashing import sha256_bytes
from storage.schemas import ACCEPTED_IMAGES, IMAGE_VECTORS
from tasks import largefine as largefine_tasks
from tasks import secmm as secmm_tasks
from tasks.framework.context import RunContext
from tasks.framework.stage import Stage, StageRun

SHARD = 16
HELD_MEMORY = Path(__file__).with_name("held_memory.py")


@functools.cache  # the tests' pools are made of the same seeds: each image is encoded once a session
def _jpeg(seed: int, side: int = 160) -> bytes:
    """A noise JPEG of ~30 KB (noise does not compress: memory use is visible)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _accepted(folder: Path, n: int, copies: dict[int, int] | None = None, side: int = 160,
              shard: int = SHARD) -> Artifact:
    """An ``accepted`` artifact of n noise images (``side`` pixels square) in shards of ``shard``,
    two domains (row i is a vehicle when i % 4 == 0); ``copies`` {row: other row}: that row holds
    the other's image."""
    writer = ArtifactWriter(str(folder), "accepted_images", ACCEPTED_IMAGES, "test")
    writer.begin()
    shards = []
    for index, start in enumerate(range(0, n, shard)):
        rows = []
        for i in range(start, min(n, start + shard)):
            data = _jpeg((copies or {}).get(i, i), side)
            rows.append({"input_id": f"in-{i}", "image_id": sha256_bytes(data), "source": f"s{i}",
                         "domain": "pedestrian" if i % 4 else "vehicle", "identity": f"p{i // 3}", "width": side,
                         "height": side, "source_mode": "RGB", "image_format": "JPEG", "exif_orientation": None,
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



def test_index_artifact_reads_the_vectors_embed_artifact_returns_without_holding_them(tmp_path: Path) -> None:
    """``index_artifact`` embeds the misses shard by shard as ``embed_artifact`` does, but returns
    where the vectors are, not the vectors: ``take`` gives exactly ``embed_artifact``'s, ``blocks``
    one pool shard's rows at a time."""
    art = _accepted(tmp_path / "accepted", 40)
    emb = MeanEmbedder()
    cache = EmbeddingCache(str(tmp_path), emb)
    vehicles = lambda r: r["domain"] == "vehicle"  # noqa: E731
    rows, vectors = cache.index_artifact(art, ["image_id", "domain"], keep=vehicles)
    assert emb.calls == 10 == len(vectors) == len(rows) and emb.largest_call <= SHARD
    reader = EmbeddingCache(str(tmp_path), MeanEmbedder())
    again_rows, direct = reader.embed_artifact(art, ["image_id", "domain"], keep=vehicles)
    assert [r["image_id"] for r in rows] == [r["image_id"] for r in again_rows]
    assert np.array_equal(vectors.take(np.arange(10)), direct)
    assert [len(b) for b in vectors.blocks(np.arange(10))] == [4, 4, 2]  # vehicles per pool shard
    _, every = cache.index_artifact(art, ["image_id"])
    assert cache.embedded == 40 and emb.calls == 40 and len(every) == 40  # the 10 vehicles were cached
    assert np.array_equal(every.take([i for i in range(40) if i % 4 == 0]), direct)


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


@functools.cache
def _parsed_profile(overrides: str) -> Profile:
    return load_profile("demo", json.loads(overrides))


def _demo_profile(overrides: dict[str, object]) -> Profile:
    """The demo profile with ``overrides``: parsed once per set of overrides (the tests ask for the
    same few about 15 times, ~20 ms of YAML each), a deep copy of it each time."""
    return _parsed_profile(json.dumps(overrides, sort_keys=True)).model_copy(deep=True)


def _prepared(stage: Stage, flow: str, folder: Path, overrides: dict[str, object], embedder: MeanEmbedder,
              monkeypatch: pytest.MonkeyPatch) -> StageRun:
    """``stage`` of ``flow`` on ``folder`` under the demo profile with ``overrides``, the registry's
    image embedder replaced by ``embedder``, its lineage run as the runner does before ``run``."""
    monkeypatch.setattr(ModelRegistry, "image_embedder", lambda self: embedder)
    run = StageRun(stage, RunContext(_demo_profile(overrides), flow, str(folder)))
    stage.lineage(run)
    return run


class VectorCounts:
    """A counting fake around every way a stage can come to hold embeddings: the cache's readers
    (``lookup``, ``embed_artifact``, ``CachedVectors.take``), what in-memory k-means is given and
    the streaming k-means' seed sample. It records how many vectors each hands out at once, so a
    test sees the most a stage ever held from one of them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.batches: list[tuple[str, int]] = []
        self.streamed = 0  # domains clustered by streaming k-means
        real_take, real_lookup, real_embed = CachedVectors.take, EmbeddingCache.lookup, EmbeddingCache.embed_artifact
        real_kmeans, real_sample, real_stream = cgds.kmeans_clusters, cgds.reservoir_sample, cgds.kmeans_streaming

        def take(vectors: CachedVectors, positions) -> np.ndarray:
            return self._count("take", real_take(vectors, positions))

        def lookup(cache: EmbeddingCache, ids) -> dict:
            found = real_lookup(cache, ids)
            self.batches.append(("lookup", len(found)))
            return found

        def embed_artifact(cache: EmbeddingCache, *args, **kwargs):
            rows, vectors = real_embed(cache, *args, **kwargs)
            return rows, self._count("embed_artifact", vectors)

        def kmeans_clusters(vectors: np.ndarray, *args, **kwargs) -> cgds.Clustering:
            self._count("kmeans_clusters", vectors)
            return real_kmeans(vectors, *args, **kwargs)

        def reservoir_sample(*args, **kwargs) -> tuple[np.ndarray, int]:
            sample, seen = real_sample(*args, **kwargs)
            return self._count("sample", sample), seen

        def kmeans_streaming(*args, **kwargs) -> cgds.Clustering:
            self.streamed += 1
            return real_stream(*args, **kwargs)

        monkeypatch.setattr(CachedVectors, "take", take)
        monkeypatch.setattr(EmbeddingCache, "lookup", lookup)
        monkeypatch.setattr(EmbeddingCache, "embed_artifact", embed_artifact)
        for name, fake in (("kmeans_clusters", kmeans_clusters), ("reservoir_sample", reservoir_sample),
                           ("kmeans_streaming", kmeans_streaming)):
            monkeypatch.setattr(cgds, name, fake)

    def _count(self, reader: str, vectors: np.ndarray) -> np.ndarray:
        self.batches.append((reader, len(vectors)))
        return vectors

    @property
    def largest(self) -> int:
        return max((n for _, n in self.batches), default=0)


STREAMED = {"sampling": {"clusters_per_domain": 3, "min_per_cluster": 2, "max_per_cluster": 8, "minibatch_above": 8,
                         "stream_batch": SHARD, "stream_init_per_cluster": 2}}


def _cgds_vectors(tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[VectorCounts, MeanEmbedder, cgds.GallerySample, list[dict]]:
    """CGDS on an n-image pool whose two domains are both above ``minibatch_above`` (streamed),
    with the vectors counted; (counts, embedder, the stage's draw, its gallery rows)."""
    folder = tmp_path / f"v{n}"
    _accepted(folder / "build-secmm" / "demo" / "distinct", n)
    embedder = MeanEmbedder()
    stage = secmm_tasks.Cgds()
    run = _prepared(stage, "build-secmm", folder, STREAMED, embedder, monkeypatch)
    with monkeypatch.context() as patch:
        counts = VectorCounts(patch)
        work = stage.run(run)
        gallery = [r for t in work.shards for r in t["gallery"].drop_columns(["image_bytes"]).to_pylist()]
    return counts, embedder, work.stats, gallery


def test_cgds_large_domains_never_hold_more_than_one_shard_of_vectors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """48 and 192 images, 16 per shard, every domain above ``minibatch_above`` (8): no reader hands
    CGDS more than one shard of vectors (16) at once, at both sizes, while the draw is the one
    in-memory ``sample_gallery`` makes from all the vectors in pool order (the streaming k-means
    depends on the rows' order, not on where blocks end). Fails when the stage gathers a large
    domain's vectors (``take`` of the domain, ``embed_artifact`` of the pool) or clusters them in
    memory (``kmeans_clusters`` of the domain)."""
    for n in (48, 192):
        counts, embedder, stats, gallery = _cgds_vectors(tmp_path, n, monkeypatch)
        assert counts.streamed == 2 and embedder.calls == n and embedder.largest_call <= SHARD
        assert counts.batches and counts.largest <= SHARD, (n, sorted(counts.batches, key=lambda b: -b[1])[:3])
        pool = Artifact(str(tmp_path / f"v{n}" / "build-secmm" / "demo" / "distinct"))
        rows = pool.rows([*cgds.GALLERY_FIELDS, "target_count"])
        vectors = MeanEmbedder().embed(decoded_list(pool))
        spec = _demo_profile(STREAMED).sampling
        expected = cgds.sample_gallery(rows, vectors, spec)
        assert [g["image_id"] for g in gallery] == [g["image_id"] for g in expected.gallery]
        assert [g["cluster"] for g in gallery] == [g["cluster"] for g in expected.gallery]
        assert stats["clusters"] == expected.clusters and len(gallery) > 0


MEASURED = (30, 8)  # the measured pool: 30 shards of 8 noise images (~0.25 MB a shard as an Arrow table)
HELD_SHARDS = 10  # the bound on each peak, in shards of that pool: a third of it
# two streamed passes over the vectors and one k-means++ start, not five and ten: the same reads, fewer of them
MEASURED_SAMPLING = {"sampling": {**STREAMED["sampling"], "stream_passes": 2, "stream_init_tries": 1}}


def test_cgds_holds_a_few_shards_in_memory_not_the_pool(tmp_path: Path) -> None:
    """CGDS (large domains streamed) over 240 images in 30 shards, measured in an interpreter of its
    own (``held_memory``): the peak it holds on Python's heap (tracemalloc) and the peak of Arrow's
    default memory pool, from the stage's start to its last output shard consumed, are each at most
    10 shards' in-memory size (one shard's Arrow table, every column), a third of the whole pool's.

    Measured (Arrow's mimalloc pool, the default here; ~70 runs): Python 4.4-5.3 shards (one
    shard's decoded pixels are 2.5, plus the pool's metadata), Arrow 5.2-7.1 (the shard before is
    still referenced while the next is read, and reading one shard's Parquet file peaks at ~4
    shards; the high ends come with the threads' timing, under load). Whatever way the stage came
    to hold every shard (``to_pandas``, a list of ``iter_shards``' tables, a direct
    ``pyarrow.parquet`` read, ``iter_batches`` kept, every decoded image), one of the two peaks is
    at least the pool's 30 shards and this fails: ``to_pandas`` of the pool, 35 and 32 shards;
    ``pq.read_table`` of its files, Arrow 36."""
    shards, per_shard = MEASURED
    warm, base = tmp_path / "warm", tmp_path / "measured"
    _accepted(warm / "build-secmm" / "demo" / "distinct", 2 * SHARD, side=16)  # 16-pixel images: ~nothing
    probe = subprocess.Popen([sys.executable, str(HELD_MEMORY), str(warm), str(base), json.dumps(MEASURED_SAMPLING)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # it imports and warms up while the measured pool is written
        pool = _accepted(base / "build-secmm" / "demo" / "distinct", shards * per_shard, shard=per_shard)
        sizes = [table.nbytes for _, table in pool.iter_shards()]
        out, err = probe.communicate("written\n", timeout=300)
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    assert probe.returncode == 0, err.split("Extension modules:")[0][-3000:]  # a crash: its stacks
    held = json.loads(out.splitlines()[-1])
    shard, whole, bound = max(sizes), sum(sizes), HELD_SHARDS * max(sizes)
    assert len(sizes) == shards and whole >= 2.9 * bound
    assert held["embedded"] == shards * per_shard and held["largest_call"] <= per_shard and held["gallery"] > 0
    assert held["arrow_before"] < shard / 2, held  # the warm-up went next to nothing through Arrow's pool
    peaks = (f"peaks: Python heap {held['python_peak']} B ({held['python_peak'] / shard:.1f} shards), Arrow "
             f"{held['arrow_backend']} pool {held['arrow_peak']} B ({held['arrow_peak'] / shard:.1f} shards); "
             f"bound {bound} B ({HELD_SHARDS} shards of {shard} B); the pool {whole} B ({len(sizes)} shards)")
    assert held["python_peak"] <= bound and held["arrow_peak"] <= bound, peaks


def decoded_list(pool: Artifact) -> list[np.ndarray]:
    """Every image of the pool, decoded, in pool order (the test's reference: all at once)."""
    return [np.asarray(Image.open(io.BytesIO(r["image_bytes"])).convert("RGB")) for r in pool.rows(["image_bytes"])]


def _embedded(folder: Path, embedder: MeanEmbedder, monkeypatch: pytest.MonkeyPatch) -> BytesReads:
    """``embed-images`` over the accepted artifact under ``folder``, shard by shard as the runner
    maps it, its shards written as the ``image_vectors`` artifact; the reads it made."""
    stage = largefine_tasks.EmbedImages()
    run = _prepared(stage, "build-largefine", folder, {}, embedder, monkeypatch)
    writer = ArtifactWriter(str(folder / "build-largefine" / "demo" / "image_vectors"), "image_vectors",
                            IMAGE_VECTORS, "test")
    writer.begin()
    with monkeypatch.context() as patch:
        reads = BytesReads(patch)
        shards = [writer.write_shard(i, stage.process(run, i).shards[0]["image_vectors"])
                  for i in range(stage.shard_count(run))]
    writer.finalize(shards, code_version="test")
    return reads


def _select_and_search(folder: Path, overrides: dict[str, object], embedder: MeanEmbedder,
                       monkeypatch: pytest.MonkeyPatch, order: list[int] | None = None
                       ) -> tuple[list[dict], list[dict], StageRun]:
    """select-images (written as its artifacts), then hard-negatives shard by shard as the runner
    maps it (in ``order``, default by index); (neighbour rows in index order, reject rows, the
    hard-negatives run)."""
    select = largefine_tasks.SelectImages()
    run = _prepared(select, "build-largefine", folder, overrides, embedder, monkeypatch)
    work = select.run(run)
    writers = {w.name: ArtifactWriter(str(folder / "build-largefine" / "demo" / w.name), w.kind, w.schema, "test")
               for w in select.writes}
    for w in writers.values():
        w.begin()
    infos: dict[str, list] = {name: [] for name in writers}
    rejects = []
    for index, tables in enumerate(work.shards):
        rejects += tables["select_rejects"].to_pylist()
        for name, w in writers.items():
            infos[name].append(w.write_shard(index, tables[name]))
    for name, w in writers.items():
        w.finalize(infos[name], code_version="test")
    stage = largefine_tasks.HardNegatives()
    search = _prepared(stage, "build-largefine", folder, overrides, embedder, monkeypatch)
    done = {i: stage.process(search, i).shards[0]["neighbours"].to_pylist()
            for i in (order if order is not None else range(stage.shard_count(search)))}
    return [r for i in sorted(done) for r in done[i]], rejects, search


def test_hard_negatives_decode_and_read_one_shard_of_images_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """embed-images then hard-negatives on 48 and 192 images, 16 per shard: the embedder is never
    handed more than one shard's images, every read of image bytes is one shard (each shard read
    once, by embed-images; hard-negatives reads no bytes), and the neighbours and hard negatives
    are those computed from all the chosen rows' vectors in pool order. Fails when a stage decodes
    every image of the pool in one call."""
    for n in (48, 192):
        folder = tmp_path / f"h{n}"
        pool = _accepted(folder / "build-largefine" / "demo" / "accepted", n)
        embedder = MeanEmbedder()
        embed_reads = _embedded(folder, embedder, monkeypatch)
        with monkeypatch.context() as patch:
            reads = BytesReads(patch)
            out, _, run = _select_and_search(folder, {"largefine": {"shard_size": 10}}, embedder, monkeypatch)
        assert reads.batches == []
        every = pool.rows(["image_id", "domain", "image_bytes"])
        chosen = [i for i, r in enumerate(every) if r["domain"] == "pedestrian"]
        assert embedder.calls == len(chosen) and embedder.largest_call <= SHARD, embedder.largest_call
        shard_bytes = [sum(len(r["image_bytes"]) for r in every[at:at + SHARD]) for at in range(0, n, SHARD)]
        assert [reader for reader, _ in embed_reads.batches] == ["read_shard"] * len(shard_bytes)
        assert embed_reads.largest <= max(shard_bytes)
        images = decoded_list(pool)
        lf = run.section("largefine")
        found = hard_negative_neighbours(MeanEmbedder().embed([images[i] for i in chosen]),
                                         [every[i]["image_id"] for i in chosen], lf.neighbours_k, lf.seed,
                                         lf.neighbour_index_above, ann=lf.neighbour_ann)
        assert [r["image_id"] for r in out] == [every[i]["image_id"] for i in chosen]
        assert [r["neighbour_ids"] for r in out] == [f.neighbour_ids for f in found]
        assert [r["hard_negative_id"] for r in out] == [f.hard_negative_id for f in found]


def test_hard_negatives_refuse_vectors_of_another_accepted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Vectors embedded from one accepted artifact are not read as another's: the ids are checked."""
    folder = tmp_path / "stale"
    _accepted(folder / "build-largefine" / "demo" / "accepted", 32)
    _embedded(folder, MeanEmbedder(), monkeypatch)
    _accepted(folder / "build-largefine" / "demo" / "accepted", 32, copies={5: 9})  # row 5 holds another image
    stage = largefine_tasks.SelectImages()
    run = _prepared(stage, "build-largefine", folder, {"largefine": {"shard_size": 10}}, MeanEmbedder(), monkeypatch)
    with pytest.raises(RuntimeError, match="does not hold the accepted images"):
        stage.run(run)


def _hard_negative_run(tmp_path: Path, n: int, monkeypatch: pytest.MonkeyPatch, copies: dict[int, int] | None = None
                       ) -> tuple[VectorCounts, list[dict], list[dict], StageRun, Artifact]:
    """HardNegatives on an n-image pool, 16 per shard, queries searched 16 at a time, with every
    vector reader counted; (counts, neighbour rows, reject rows, the run, the pool)."""
    folder = tmp_path / f"hv{n}"
    pool = _accepted(folder / "build-largefine" / "demo" / "accepted", n, copies)
    _embedded(folder, MeanEmbedder(), monkeypatch)
    monkeypatch.setattr(largefine_tasks.HardNegatives, "query_batch", SHARD)
    with monkeypatch.context() as patch:
        counts = VectorCounts(patch)
        out, rejects, run = _select_and_search(folder, {"largefine": {"shard_size": 10}}, MeanEmbedder(), monkeypatch)
    return counts, out, rejects, run, pool


def _in_memory(run: StageRun, pool: Artifact, rows: list[int]) -> list:
    """The reference: ``hard_negative_neighbours`` on all the given pool rows' vectors at once."""
    every = pool.rows(["image_id"])
    images = decoded_list(pool)
    lf = run.section("largefine")
    return hard_negative_neighbours(MeanEmbedder().embed([images[i] for i in rows]),
                                    [every[i]["image_id"] for i in rows], lf.neighbours_k, lf.seed,
                                    lf.neighbour_index_above, ann=lf.neighbour_ann)


def test_hard_negatives_never_hold_more_than_a_query_batch_or_a_shard_of_vectors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """48 and 192 images (36 and 144 chosen), 16 per shard, at most 16 queries at a time: no reader
    hands the stage more than 16 vectors at once at either size (12 of a shard are pedestrians;
    batches of 12 and 16 queries), and the neighbours, scores and hard negatives equal the
    in-memory search over all the chosen vectors. Fails when the stage gathers the chosen rows'
    vectors (``embed_artifact``, or ``take`` of every row) to search them all against all."""
    largest: dict[int, int] = {}
    for n in (48, 192):
        counts, out, _, run, pool = _hard_negative_run(tmp_path, n, monkeypatch)
        chosen = [i for i in range(n) if i % 4]
        assert len(out) == len(chosen) and counts.batches
        largest[n] = counts.largest
        found = _in_memory(run, pool, chosen)
        assert [(r["image_id"], r["neighbour_ids"], r["hard_negative_id"]) for r in out] == [
            (f.image_id, f.neighbour_ids, f.hard_negative_id) for f in found]
        assert np.allclose([r["neighbour_scores"] for r in out], [f.scores for f in found], rtol=0, atol=1e-6)
    assert max(largest.values()) <= SHARD, (largest, counts.batches)  # 36 → 144 chosen: the bound stays


def test_hard_negatives_search_each_block_of_shards_in_one_pass_in_any_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """144 chosen images in 15 shards of 10, query batches of 40 rows: shards 0-3, 4-7, 8-11 and
    12-14 are the search blocks. Computed shard by shard in a shuffled order (as the shards of a
    fanned-out run arrive), the gallery is streamed once per block (4 passes, not 15), and the
    neighbours, scores and hard negatives equal the in-memory search over all the chosen vectors.
    Fails when each shard searches on its own, or when a shard takes the wrong rows of its block."""
    folder = tmp_path / "blocks"
    pool = _accepted(folder / "build-largefine" / "demo" / "accepted", 192)
    _embedded(folder, MeanEmbedder(), monkeypatch)
    monkeypatch.setattr(largefine_tasks.HardNegatives, "query_batch", 40)
    passes = []
    real_blocks = CachedVectors.blocks

    def blocks(vectors: CachedVectors, rows):
        passes.append(len(rows))
        return real_blocks(vectors, rows)

    monkeypatch.setattr(CachedVectors, "blocks", blocks)
    order = [int(i) for i in np.random.default_rng(3).permutation(15)]
    out, _, run = _select_and_search(folder, {"largefine": {"shard_size": 10}}, MeanEmbedder(), monkeypatch, order)
    assert passes == [144] * 4, passes
    found = _in_memory(run, pool, [i for i in range(192) if i % 4])
    assert [(r["image_id"], r["neighbour_ids"], r["hard_negative_id"]) for r in out] == [
        (f.image_id, f.neighbour_ids, f.hard_negative_id) for f in found]
    assert [r["neighbour_scores"] for r in out] == [pytest.approx(f.scores, abs=1e-6) for f in found]


def test_hard_negatives_keep_a_duplicate_image_by_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One image in two domains (rows 4, a vehicle, and 5, a pedestrian) and twice among the
    pedestrians (rows 5 and 6): the pedestrian rows are chosen, the vehicle copy is rejected
    ``out_of_domain``, and both pedestrian copies get neighbours that exclude their own image, as
    the in-memory search over the chosen rows gives."""
    _, out, rejects, run, pool = _hard_negative_run(tmp_path, 32, monkeypatch, copies={5: 4, 6: 4})
    every = pool.rows(["image_id", "domain"])
    chosen = [i for i in range(32) if i % 4]
    assert [r["image_id"] for r in out] == [every[i]["image_id"] for i in chosen]
    same = every[4]["image_id"]
    assert [r["image_id"] for r in out].count(same) == 2 and every[5]["domain"] == "pedestrian"
    assert sum(r["reason"] == "out_of_domain" and r["image_id"] == same for r in rejects) == 1
    found = _in_memory(run, pool, chosen)
    assert [(r["neighbour_ids"], r["hard_negative_id"]) for r in out] == [
        (f.neighbour_ids, f.hard_negative_id) for f in found]
    assert all(same not in r["neighbour_ids"] for r in out if r["image_id"] == same)
