"""The near-duplicate filter (rde/secmm/near_duplicates.py) against cosines computed by hand, and
its stage (tasks/secmm/near_duplicates.py) over a tiny pool: kept rows copied shard by shard,
each dropped image a ``near_duplicate`` row naming its kept twin, the embeddings from the cache."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from models.backends.registry import ModelRegistry
from rde.common.embedding_cache import EmbeddingCache
from rde.profile import load_profile
from rde.secmm import near_duplicates as nd
from rde.secmm.near_duplicates import NearDuplicateSpec
from storage import ArtifactWriter
from storage.hashing import sha256_bytes
from storage.schemas import ACCEPTED_IMAGES
from tasks.framework.accounting import check_balance, check_reasons
from tasks.framework.context import RunContext
from tasks.framework.stage import StageRun
from tasks.secmm.near_duplicates import NearDuplicates


def _kept_and_twins(result: nd.Deduplication) -> tuple[list[str], dict[str, tuple[str, float]]]:
    kept = [d.image_id for d in result.decisions if d.kept]
    twins = {d.image_id: (d.twin, d.cosine) for d in result.decisions if not d.kept}
    return kept, twins


def test_greedy_keeps_the_sharpest_and_names_the_kept_twin_with_the_highest_cosine() -> None:
    """a=(1,0,0), b=(12,5,0)/13, c=(4,3,0)/5, d=(0,0,1), e=(24,7,0)/25 (given unnormalised).
    Cosines by hand: ab 12/13=.923, ac .8, bc 63/65=.969, ae 24/25=.96, be 323/325=.994, ce 117/125=.936.
    Sharpness order a, c, b, e, d at threshold .95: a kept; c kept (.8 to a); b dropped (.969 to c);
    e dropped as a's twin (.96 to a beats .936 to c; b, closer at .994, was not kept); d kept."""
    vectors = np.array([[2, 0, 0], [12, 5, 0], [4, 3, 0], [0, 0, 3], [24, 7, 0]], np.float32)
    result = nd.find_near_duplicates(list("abcde"), ["pedestrian"] * 5, [300.0, 200.0, 250.0, 10.0, 100.0],
                                     vectors, NearDuplicateSpec(threshold=0.95))
    kept, twins = _kept_and_twins(result)
    assert kept == ["a", "c", "d"]
    assert twins == {"b": ("c", pytest.approx(63 / 65, abs=1e-12)), "e": ("a", pytest.approx(0.96, abs=1e-12))}
    assert result.by_domain == [nd.DomainCount("pedestrian", 5, 1, 3, 2)]
    # sharper e (it comes first): e kept, then a is e's twin and c (.936 to e) is kept, b is c's twin
    result = nd.find_near_duplicates(list("abcde"), ["pedestrian"] * 5, [300.0, 200.0, 250.0, 10.0, 900.0],
                                     vectors, NearDuplicateSpec(threshold=0.95))
    kept, twins = _kept_and_twins(result)
    assert kept == ["c", "d", "e"] and {k: t for k, (t, _) in twins.items()} == {"a": "e", "b": "e"}


def test_ties_in_sharpness_and_in_cosine_go_to_the_smaller_image_id() -> None:
    same = np.array([[1, 2, 3], [1, 2, 3]], np.float32)
    for ids in (["x", "y"], ["y", "x"]):  # equal sharpness: "x" kept, wherever it stands
        kept, twins = _kept_and_twins(nd.find_near_duplicates(ids, ["v", "v"], [5.0, 5.0], same, NearDuplicateSpec()))
        assert kept == ["x"] and twins == {"y": ("x", pytest.approx(1.0))}
    # a missing (or NaN) sharpness is the least sharp: below 0, whatever the image ids say
    for missing in (None, float("nan")):
        kept, _ = _kept_and_twins(nd.find_near_duplicates(["a", "b"], ["v", "v"], [missing, 0.0], same,
                                                          NearDuplicateSpec()))
        assert kept == ["b"]
    # r is at 1/√2 to both kept images p ("b", sharper) and q ("a"): its twin is "a", the smaller id
    vectors = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0]], np.float32)
    _, twins = _kept_and_twins(nd.find_near_duplicates(["b", "a", "r"], ["v"] * 3, [100.0, 50.0, 1.0], vectors,
                                                       NearDuplicateSpec(threshold=0.7)))
    assert twins == {"r": ("a", pytest.approx(2 ** -0.5))}


def test_a_cosine_equal_to_the_threshold_is_kept_and_one_above_is_dropped() -> None:
    vectors = np.array([[1, 0, 0], [3, 4, 0]], np.float32)  # cosine 3/5 = 0.6, exact in float64
    at = nd.find_near_duplicates(["a", "b"], ["v", "v"], [2.0, 1.0], vectors, NearDuplicateSpec(threshold=0.6))
    assert [d.kept for d in at.decisions] == [True, True]
    above = nd.find_near_duplicates(["a", "b"], ["v", "v"], [2.0, 1.0], vectors, NearDuplicateSpec(threshold=0.599))
    assert [(d.kept, d.twin) for d in above.decisions] == [(True, None), (False, "a")]
    # 1.0 keeps even an exact copy (cosines are clipped to 1)
    copies = np.array([[0.1, 0.7, 0.3]] * 3, np.float32)
    assert all(d.kept for d in nd.find_near_duplicates(list("abc"), ["v"] * 3, [1.0] * 3, copies,
                                                       NearDuplicateSpec(threshold=1.0)).decisions)


def test_domains_are_filtered_apart() -> None:
    """The same vector in two domains: both kept; a third copy in one of them is dropped."""
    vectors = np.array([[1, 1, 0], [1, 1, 0], [1, 1, 0]], np.float32)
    result = nd.find_near_duplicates(["p", "v", "v2"], ["pedestrian", "vehicle", "vehicle"], [1.0, 2.0, 1.0],
                                     vectors, NearDuplicateSpec())
    assert [(d.image_id, d.domain, d.twin) for d in result.decisions] == [
        ("p", "pedestrian", None), ("v", "vehicle", None), ("v2", "vehicle", "v")]
    assert [(c.domain, c.kept, c.dropped) for c in result.by_domain] == [("pedestrian", 1, 0), ("vehicle", 1, 1)]


def _groups(seed: int = 0) -> tuple[list[str], np.ndarray, list[float]]:
    """Three groups of four near copies (noise 0.01 around three orthogonal directions, 8-d)."""
    rng = np.random.default_rng(seed)
    centres = np.eye(8)[:3]
    vectors = np.concatenate([c + 0.01 * rng.standard_normal((4, 8)) for c in centres])
    return [f"i{k:02d}" for k in range(12)], vectors.astype(np.float32), list(rng.uniform(50, 500, 12))


def test_a_domain_above_cluster_size_is_split_by_kmeans_and_compared_within_clusters() -> None:
    ids, vectors, sharpness = _groups()
    spec = NearDuplicateSpec(threshold=0.99, cluster_size=4, seed=3)  # 12 images: ceil(12/4) = 3 clusters
    labels = nd.cluster_labels(nd.normalised(vectors), spec.cluster_size, spec.seed)
    assert sorted(np.bincount(labels).tolist()) == [4, 4, 4]
    assert all(len(set(labels[g * 4:(g + 1) * 4])) == 1 for g in range(3))  # one cluster per group
    result = nd.find_near_duplicates(ids, ["v"] * 12, sharpness, vectors, spec)
    assert result.by_domain == [nd.DomainCount("v", 12, 3, 3, 9)]
    kept = [d.image_id for d in result.decisions if d.kept]
    assert kept == [max(ids[g * 4:(g + 1) * 4], key=lambda i: sharpness[ids.index(i)]) for g in range(3)]
    assert result.decisions == nd.find_near_duplicates(ids, ["v"] * 12, sharpness, vectors, spec).decisions
    exact = nd.find_near_duplicates(ids, ["v"] * 12, sharpness, vectors, NearDuplicateSpec(threshold=0.99))
    assert exact.by_domain[0].clusters == 1 and [d.twin for d in exact.decisions] == [
        d.twin for d in result.decisions]


def test_blocks_of_the_greedy_pass_decide_as_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    vectors = (np.repeat(rng.standard_normal((10, 6)), 4, axis=0) + 0.15 * rng.standard_normal((40, 6)))
    ids, sharpness = [f"{k:02d}" for k in range(40)], list(rng.uniform(0, 100, 40))
    whole = nd.find_near_duplicates(ids, ["v"] * 40, sharpness, vectors, NearDuplicateSpec(threshold=0.97))
    assert 5 < whole.dropped < 35
    monkeypatch.setattr(nd, "BLOCK", 3)
    assert nd.find_near_duplicates(ids, ["v"] * 40, sharpness, vectors,
                                   NearDuplicateSpec(threshold=0.97)).decisions == whole.decisions


# -- the stage --------------------------------------------------------------------------------------

class MeanEmbedder:
    """A 3-d embedding (the channel means): no model, deterministic; counts the images it embeds."""

    model_id, preprocessing, dim = "channel-means", "none", 3

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        self.calls += len(images)
        return np.stack([im.reshape(-1, 3).mean(0) / 255.0 for im in images]).astype(np.float32)


def _png(colour: tuple[int, int, int], side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, "PNG")
    return buf.getvalue()


# (domain, colour, laplacian variance) per shard; the two reds of the pedestrians are at cosine
# 250/√(250²+10²) = 0.9992: the sharper (400) is kept; the vehicles' red is another domain's
POOL = [[("pedestrian", (255, 0, 0), 300.0), ("pedestrian", (0, 0, 255), 200.0), ("vehicle", (255, 0, 0), 90.0)],
        [("pedestrian", (250, 10, 0), 400.0), ("vehicle", (0, 255, 0), 120.0)]]


def _pool(url: str) -> list[list[str]]:
    """The accepted pool of POOL (in two shards); the image ids per shard."""
    writer = ArtifactWriter(url, "accepted_images", ACCEPTED_IMAGES, "test")
    writer.begin()
    shards, ids = [], []
    for index, shard in enumerate(POOL):
        rows = []
        for k, (domain, colour, sharpness) in enumerate(shard):
            data = _png(colour, 8 + index * 3 + k)  # sizes differ: no two images share an id
            rows.append({"input_id": f"in-{index}-{k}", "image_id": sha256_bytes(data), "source": f"s{index}{k}",
                         "domain": domain, "identity": None, "width": 8, "height": 8, "source_mode": "RGB",
                         "image_format": "PNG", "exif_orientation": None, "source_meta": None, "image_bytes": data,
                         "laplacian_variance": sharpness, "target_count": 1, "target_scores": [0.9],
                         "target_boxes": [[0, 0, 1, 1]]})
        ids.append([r["image_id"] for r in rows])
        shards.append(writer.write_shard(index, pa.Table.from_pylist(rows, schema=ACCEPTED_IMAGES)))
    writer.finalize(shards, code_version="test")
    return ids


def test_the_stage_copies_the_kept_rows_per_shard_and_rejects_the_duplicate_naming_its_twin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's own part, as the runner calls it (lineage, then run, its shards consumed one at a
    time), without the runner's Prefect task: a temporary Prefect server costs ~10 s to start."""
    embedder = MeanEmbedder()
    monkeypatch.setattr(ModelRegistry, "image_embedder", lambda self: embedder)
    ctx = RunContext(load_profile("demo"), "build-secmm", str(tmp_path))
    ids = _pool(ctx.artifact_url("accepted"))
    stage = NearDuplicates()
    run = StageRun(stage, ctx)
    stage.lineage(run)
    run.check_prepared()
    work = stage.run(run)
    shards = list(work.shards)
    stats = work.stats
    check_reasons(stage.name, stats)
    assert check_balance(stage.name, stats)
    assert (stats["input_rows"], stats["accepted"], stats["rejected"]) == (5, 4, {"near_duplicate": 1})
    assert stats["by_domain"] == [
        {"domain": "pedestrian", "images": 3, "clusters": 1, "kept": 2, "dropped": 1},
        {"domain": "vehicle", "images": 2, "clusters": 1, "kept": 2, "dropped": 0}]
    assert [set(s) for s in shards] == [{w.name for w in stage.writes}] * 2
    distinct = [s["distinct"] for s in shards]
    assert all(t.schema == ACCEPTED_IMAGES for t in distinct)
    assert [t.column("image_id").to_pylist() for t in distinct] == [ids[0][1:], ids[1]]  # per shard, in order
    assert distinct[0].column("image_bytes").to_pylist()[0] == _png((0, 0, 255), 9)
    assert [s["near_duplicates"].num_rows for s in shards] == [1, 0]  # in the shard of its input
    (row,) = shards[0]["near_duplicates"].to_pylist()
    assert (row["image_id"], row["input_id"], row["domain"], row["reason"], row["stage"], row["laplacian_variance"]) \
        == (ids[0][0], "in-0-0", "pedestrian", "near_duplicate", "near-duplicates", 300.0)
    assert row["detail"] == f"near-duplicate of {ids[1][0]} (cosine 0.9992)"
    report = stage.report(run, SimpleNamespace(stats=stats))
    assert report.tables[0][1] == stats["by_domain"] and "pedestrian 1 of 3 dropped" in report.log
    # embedded once, into the cache CGDS reads: a second pass (or CGDS) embeds nothing
    every = [i for shard in ids for i in shard]
    assert embedder.calls == 5 and set(EmbeddingCache(ctx.base, embedder).locate(every)) == set(every)
    stage.lineage(run)
    list(stage.run(run).shards)
    assert embedder.calls == 5


def test_the_stage_writes_one_empty_shard_for_an_empty_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelRegistry, "image_embedder", lambda self: MeanEmbedder())
    ctx = RunContext(load_profile("demo"), "build-secmm", str(tmp_path))
    writer = ArtifactWriter(ctx.artifact_url("accepted"), "accepted_images", ACCEPTED_IMAGES, "test")
    writer.begin()
    writer.finalize([], code_version="test")
    stage = NearDuplicates()
    run = StageRun(stage, ctx)
    stage.lineage(run)
    work = stage.run(run)
    assert [(s["distinct"].num_rows, s["near_duplicates"].num_rows) for s in work.shards] == [(0, 0)]
    assert (work.stats["input_rows"], work.stats["accepted"], work.stats["rejected"]) == (0, 0, {})
