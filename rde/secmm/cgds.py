"""Centroid-Guided Diversity Sampling (DSMM-TBIR, Sec. 3.1 / App. A).

Embeddings of one domain's pool are clustered with k-means (K≈100 per domain in production);
from each cluster n images are drawn at random, n uniform in [min, max] and at most the
cluster's size. Drawing per cluster (not from the whole pool) keeps rare looks represented.

A domain at or below ``sampling.minibatch_above`` images is clustered in memory (scikit-learn
KMeans); a larger one by :func:`kmeans_streaming` (Lloyd passes over blocks), whose vectors arrive block by block
(the stage reads them from the embedding cache one pool shard at a time), so no step holds the
domain's N × dim vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, model_validator

from models.specs import Strict
from rde.common.declarations import profile_section
from rde.common.openmp_threads import at_most_two_openmp_threads
from storage import Artifact
from storage.schemas import GALLERY, SAMPLING

Blocks = Callable[[], Iterable[np.ndarray]]  # a fresh iterator of float32 blocks (rows × dim), same order each call


@profile_section("sampling", "Centroid-guided diversity sampling (CGDS) of the gallery.")
class SamplingSpec(Strict):
    """Centroid-Guided Diversity Sampling sizes (paper Sec. 3.1)."""

    clusters_per_domain: int = Field(100, ge=1, description="K of the k-means clustering of each domain's "
                                     "image embeddings.")
    min_per_cluster: int = Field(100, ge=0, description="Fewest images drawn from a cluster (capped at its "
                                 "size; at most max_per_cluster).")
    max_per_cluster: int = Field(1000, ge=1, description="Most images drawn from a cluster: each draws a "
                                 "seeded number between min_per_cluster and this.")
    seed: int = Field(0, description="Seed of the clustering and the draws.")
    kmeans_backend: Literal["auto", "sklearn", "sklearn-minibatch", "faiss", "streaming"] = Field(
        "auto", description="k-means implementation: auto = scikit-learn in memory up to minibatch_above images "
        "per domain and streaming above; streaming = always; the others hold all vectors in memory at any size.")
    # streaming k-means is kmeans_streaming below
    minibatch_above: int = Field(20_000, ge=1, description="With auto: above this many images per domain, "
                                 "streaming k-means reads the vectors one pool shard at a time, never all at once.")
    stream_passes: int = Field(5, ge=1, description="Streaming: at most this many Lloyd passes (it stops "
                               "earlier when no label changes).")
    stream_batch: int = Field(4096, ge=1, description="Streaming: vectors per step (its distance matrix is "
                              "stream_batch × K floats).")
    stream_init_per_cluster: int = Field(256, ge=1, description="Streaming: the start is k-means on a seeded "
                                         "sample of min(N, this × K) vectors, held in memory (131 MB at K=100, "
                                         "dim 1280).")
    stream_init_tries: int = Field(10, ge=1, description="Streaming: k-means++ starts tried on that sample.")

    @model_validator(mode="after")
    def _bounds(self) -> SamplingSpec:
        if self.min_per_cluster > self.max_per_cluster:
            raise ValueError("sampling.min_per_cluster must not exceed sampling.max_per_cluster")
        return self


@dataclass
class Clustering:
    labels: np.ndarray  # cluster id per item
    centroids: np.ndarray
    inertia: float


def kmeans_clusters(vectors: np.ndarray, k: int, seed: int, backend: str = "auto",
                    minibatch_above: int = 20_000) -> Clustering:
    """k-means on L2-normalised vectors held in memory; K is capped at the number of items.

    ``backend``: ``sklearn`` (Lloyd KMeans, k-means++ init, 3 inits), ``sklearn-minibatch``
    (MiniBatchKMeans, 3 inits), ``faiss`` (k-means++ seeds from a 256-per-centroid subsample, then
    20 faiss iterations and a nearest-centroid assignment of every point), ``streaming``
    (:func:`kmeans_streaming` over the rows in order, default settings), or ``auto`` =
    sklearn up to ``minibatch_above`` items, sklearn-minibatch above. (The CGDS stage never calls
    this above ``minibatch_above`` with ``auto``: it streams, see :func:`cluster_domain`.)

    Why not faiss by default (benchmarks/cgds_mecf_scaling.py, 1M×768, K=100): MiniBatchKMeans
    takes ~12 s and scales as N^0.34; faiss is 2–4× faster but ends at a 7–11 % higher inertia,
    and clustering runs once while embedding a million images takes hours.
    """
    n = len(vectors)
    if n == 0:
        return Clustering(np.zeros(0, np.int64), np.zeros((0, vectors.shape[1] if vectors.ndim == 2 else 0)), 0.0)
    k = max(1, min(k, n))
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if backend == "faiss":
        return _faiss_kmeans(x, k, seed)
    if backend == "streaming":
        return kmeans_streaming(lambda: [x], k, seed)
    from sklearn.cluster import KMeans, MiniBatchKMeans  # here: sklearn costs every process ~2 s to import

    if backend == "sklearn-minibatch" or (backend == "auto" and n > minibatch_above):
        model = MiniBatchKMeans(n_clusters=k, random_state=seed, batch_size=4096, n_init=3)
    else:
        model = KMeans(n_clusters=k, random_state=seed, n_init=3)
    with at_most_two_openmp_threads():
        labels = model.fit_predict(x)
    return Clustering(labels.astype(np.int64), model.cluster_centers_, float(model.inertia_))


def _faiss_kmeans(x: np.ndarray, k: int, seed: int) -> Clustering:
    import faiss
    from sklearn.cluster import kmeans_plusplus

    rng = np.random.default_rng(seed)
    sample = x[rng.choice(len(x), size=min(len(x), 256 * k), replace=False)]
    init, _ = kmeans_plusplus(sample, k, random_state=seed)  # faiss seeds at random: worse optima
    km = faiss.Kmeans(x.shape[1], k, niter=20, seed=seed, verbose=False)
    km.train(x, init_centroids=np.ascontiguousarray(init, dtype=np.float32))
    dist, labels = km.index.search(x, 1)
    return Clustering(labels[:, 0].astype(np.int64), km.centroids, float(dist.sum()))


def rebatched(blocks: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The rows of ``blocks`` in order, re-cut into float32 batches of exactly ``size`` rows (the
    last one smaller): what follows depends on the row order only, not on where blocks end.
    Holds one block and one batch."""
    pending: list[np.ndarray] = []
    held = 0
    for block in blocks:
        block = np.asarray(block, dtype=np.float32)
        while len(block):
            take = min(size - held, len(block))
            pending.append(block[:take])
            held += take
            block = block[take:]
            if held == size:
                yield np.ascontiguousarray(np.concatenate(pending)) if len(pending) > 1 else pending[0]
                pending, held = [], 0
    if held:
        yield np.ascontiguousarray(np.concatenate(pending)) if len(pending) > 1 else pending[0]


def reservoir_sample(batches: Iterable[np.ndarray], size: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """A uniform sample of ``size`` rows (all rows when fewer) of the stream, in one pass
    (Algorithm R, vectorised per batch: row t replaces slot j ~ U{0..t} when j < size, a later row
    winning a slot drawn twice), and the number of rows seen. Memory: the sample."""
    sample: np.ndarray | None = None
    seen = 0
    for batch in batches:
        if sample is None:
            sample = np.empty((size, batch.shape[1]), np.float32)
        t = np.arange(seen, seen + len(batch))
        fill = t < size
        sample[t[fill]] = batch[fill]
        rest = np.flatnonzero(~fill)
        if len(rest):
            slot = rng.integers(0, t[rest] + 1)
            hit = slot < size
            slot, row = slot[hit][::-1], rest[hit][::-1]  # reversed: np.unique's first = the latest row
            slots, first = np.unique(slot, return_index=True)
            sample[slots] = batch[row[first]]
        seen += len(batch)
    if sample is None:
        return np.zeros((0, 0), np.float32), 0
    return sample[:min(seen, size)], seen


def kmeans_streaming(blocks: Blocks, k: int, seed: int, passes: int = 5, batch_size: int = 4096,
                     init_per_cluster: int = 256, init_tries: int = 10) -> Clustering:
    """k-means (Lloyd) over vectors that arrive as blocks and are never all in memory.

    ``blocks()`` returns a fresh iterator of float32 blocks (rows × dim) in the same order on every
    call. Pass 1: a seeded reservoir sample of min(N, ``init_per_cluster`` · K) rows (K capped at
    N), clustered in memory by scikit-learn KMeans (k-means++ seeds, ``init_tries`` tries, the best
    kept): its centroids start the stream. Then at most ``passes`` Lloyd passes: every row to its
    nearest centroid, each centroid moved to the mean of its rows (summed in float64; an empty
    one stays), stopping as soon as no row changes cluster (the pass's labels and inertia are
    then final); otherwise one more pass assigns the labels and sums the inertia (squared
    distance to the nearest centroid).

    Why Lloyd passes and not ``MiniBatchKMeans.partial_fit`` over the blocks: a pool arrives in
    shard order (crops of one video together), and partial_fit's running means follow that
    order; on 20k × 64, 50 planted clusters read in cluster order (3 data seeds), three
    partial_fit passes from the same seeds ended at ARI 0.81–0.97 and 0.99–1.10× KMeans'
    inertia, three Lloyd passes at ARI 0.95–0.97 and 0.99–1.01× (both as KMeans in shuffled
    order). A Lloyd pass costs what a partial_fit pass costs (the distances to the K centroids)
    and does not depend on the rows' order.

    Memory: one block, one batch of ``batch_size`` rows (and its batch × K distances), the sample
    and the centroids, plus two arrays of N labels; never N × dim. Deterministic for a seed and a
    row order (block boundaries do not matter: rows are re-cut into batches).
    """
    from sklearn.cluster import KMeans

    rng = np.random.default_rng(seed)
    sample, n = reservoir_sample(rebatched(blocks(), batch_size), max(1, init_per_cluster * k), rng)
    if n == 0:
        return Clustering(np.zeros(0, np.int64), np.zeros((0, sample.shape[1])), 0.0)
    k = max(1, min(k, n))
    with at_most_two_openmp_threads():
        centroids = KMeans(n_clusters=k, random_state=seed, n_init=init_tries).fit(sample).cluster_centers_
    centroids = np.asarray(centroids, dtype=np.float32)
    del sample
    previous: np.ndarray | None = None
    for _ in range(passes):
        sums = np.zeros(centroids.shape, np.float64)
        counts = np.zeros(k, np.int64)
        labels, inertia = _assign(blocks, centroids, batch_size, n, sums, counts)
        if previous is not None and np.array_equal(labels, previous):
            return Clustering(labels, centroids, inertia)  # converged: these centroids give these labels
        moved = counts > 0
        centroids = centroids.copy()
        centroids[moved] = (sums[moved] / counts[moved, None]).astype(np.float32)
        previous = labels
    labels, inertia = _assign(blocks, centroids, batch_size, n)
    return Clustering(labels, centroids, inertia)


def _assign(blocks: Blocks, centroids: np.ndarray, batch_size: int, n: int, sums: np.ndarray | None = None,
            counts: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """One pass: every row's nearest centroid and the inertia; with ``sums``/``counts``, also each
    centroid's sum of rows and row count (for the Lloyd update)."""
    labels = np.empty(n, np.int64)
    inertia, at = 0.0, 0
    for batch in rebatched(blocks(), batch_size):
        if at + len(batch) > n:
            raise ValueError(f"blocks() gave more than the {n} rows of its first pass: not the same rows")
        found, dist = nearest_centroid(batch, centroids)
        labels[at:at + len(batch)] = found
        inertia += float(dist.sum(dtype=np.float64))
        at += len(batch)
        if sums is not None and counts is not None:
            order = np.argsort(found, kind="stable")
            present, starts = np.unique(found[order], return_index=True)
            sums[present] += np.add.reduceat(batch[order].astype(np.float64), starts, axis=0)
            counts += np.bincount(found, minlength=len(counts))
    if at != n:
        raise ValueError(f"blocks() gave {at} rows on a later pass and {n} on its first: not the same rows")
    return labels, inertia


def nearest_centroid(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's nearest centroid (the lower index on a tie) and its squared distance."""
    d = (np.einsum("ij,ij->i", x, x)[:, None] - 2.0 * (x @ centroids.T)
         + np.einsum("ij,ij->i", centroids, centroids)[None, :])
    labels = np.argmin(d, axis=1)
    return labels.astype(np.int64), np.maximum(d[np.arange(len(x)), labels], 0.0)


def streams(n: int, spec: SamplingSpec) -> bool:
    """Whether a domain of ``n`` images is clustered by streaming (``auto`` above ``minibatch_above``)."""
    return spec.kmeans_backend == "streaming" or (spec.kmeans_backend == "auto" and n > spec.minibatch_above)


def cluster_domain(n: int, spec: SamplingSpec, gather: Callable[[], np.ndarray], blocks: Blocks) -> Clustering:
    """One domain's clustering: streamed (``blocks``) where :func:`streams`, else in memory on
    ``gather()`` (the domain's n × dim vectors; at most ``minibatch_above`` of them with ``auto``)."""
    if streams(n, spec):
        return kmeans_streaming(blocks, spec.clusters_per_domain, spec.seed, spec.stream_passes, spec.stream_batch,
                                spec.stream_init_per_cluster, spec.stream_init_tries)
    return kmeans_clusters(gather(), spec.clusters_per_domain, spec.seed, spec.kmeans_backend, spec.minibatch_above)


def sample_per_cluster(labels: np.ndarray, min_n: int, max_n: int, seed: int) -> np.ndarray:
    """Indices drawn per cluster: n_c ~ U{min_n..max_n}, capped at the cluster size, without
    replacement. Deterministic for a seed (clusters visited in id order); returned sorted."""
    rng = np.random.default_rng(seed)
    chosen: list[np.ndarray] = []
    for cluster in np.unique(labels):
        members = np.flatnonzero(labels == cluster)
        n = min(int(rng.integers(min_n, max_n + 1)), len(members))
        chosen.append(rng.choice(members, size=n, replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)


GALLERY_FIELDS = ("image_id", "domain", "identity", "source", "width", "height")  # + the image's bytes, added
# by the stage while it streams the pool: the draw itself works on embeddings and metadata only


@dataclass
class GallerySample:
    """CGDS over a whole pool: the gallery rows (metadata, no bytes), one sampling row per input
    image (sampled, or the reason it is not: ``not_sampled``, ``wrong_category``), and each
    cluster's size and draw. Both lists are ordered by domain, then by input order."""

    gallery: list[dict[str, Any]] = field(default_factory=list)
    sampling: list[dict[str, Any]] = field(default_factory=list)
    clusters: list[dict[str, Any]] = field(default_factory=list)


def sample_gallery(rows: list[dict[str, Any]], vectors: np.ndarray, spec: SamplingSpec) -> GallerySample:
    """Per domain: k-means on the embeddings, a random draw per cluster, then the category check
    (the domain's target must have been detected: ``target_count`` ≥ 1, which the paper asks a VLM).
    ``rows`` need the ``GALLERY_FIELDS`` and ``target_count``; ``vectors`` is one row per input."""
    return draw_gallery(rows, spec, lambda idx: vectors[idx],
                        lambda idx: (vectors[idx[at:at + spec.stream_batch]]
                                     for at in range(0, len(idx), spec.stream_batch)))


def draw_gallery(rows: list[dict[str, Any]], spec: SamplingSpec, gather: Callable[[np.ndarray], np.ndarray],
                 blocks: Callable[[np.ndarray], Iterable[np.ndarray]]) -> GallerySample:
    """:func:`sample_gallery` with the vectors supplied on demand: ``gather(idx)`` the vectors of
    the rows ``idx`` (one domain, in input order) at once, ``blocks(idx)`` the same rows as blocks
    in that order (a fresh iterator per call). The clustering, hence the draw, depends on the rows'
    vectors and order only, not on which of the two supplied them or where blocks end."""
    out = GallerySample()
    for domain in sorted({r["domain"] for r in rows}):
        idx = np.array([i for i, r in enumerate(rows) if r["domain"] == domain])
        clusters = cluster_domain(len(idx), spec, lambda idx=idx: gather(idx), lambda idx=idx: blocks(idx))
        picked = set(idx[sample_per_cluster(clusters.labels, spec.min_per_cluster, spec.max_per_cluster,
                                            spec.seed)].tolist())
        for c in np.unique(clusters.labels):
            members = idx[clusters.labels == c]
            out.clusters.append({"domain": domain, "cluster": int(c), "size": len(members),
                                 "sampled": sum(int(m) in picked for m in members)})
        for i, label in zip(idx, clusters.labels, strict=True):
            r = rows[int(i)]
            reason = None if int(i) in picked else "not_sampled"
            if reason is None and not (r["target_count"] or 0) >= 1:
                reason = "wrong_category"
            out.sampling.append({"image_id": r["image_id"], "domain": domain, "cluster": int(label),
                                 "sampled": reason is None, "reason": reason})
            if reason is None:
                out.gallery.append({**{k: r[k] for k in GALLERY_FIELDS}, "cluster": int(label)})
    return out


def gallery_shards(accepted: Artifact, drawn: GallerySample) -> Iterator[dict[str, pa.Table]]:
    """The gallery and sampling rows, per domain and pool shard, with the gallery's bytes read from
    that pool shard only (empty pairs skipped; at least one shard, so an empty draw is written)."""
    shard_of: dict[str, int] = {}
    for index, table in accepted.iter_shards(["image_id"]):
        for image_id in table.column("image_id").to_pylist():
            shard_of.setdefault(image_id, index)
    groups: dict[tuple[str, int], tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for s in drawn.sampling:  # input order within a domain: grouping by shard keeps it
        groups.setdefault((s["domain"], shard_of[s["image_id"]]), ([], []))[1].append(s)
    for g in drawn.gallery:
        groups[(g["domain"], shard_of[g["image_id"]])][0].append(g)
    for (_, index), (gallery, sampling) in sorted(groups.items()):
        if gallery:
            shard = accepted.read_shard(index, ["image_id", "image_bytes"])
            data = dict(zip(shard.column("image_id").to_pylist(), shard.column("image_bytes").to_pylist(),
                            strict=True))  # one pool shard's bytes
            gallery = [{**g, "image_bytes": data[g["image_id"]]} for g in gallery]
        yield {"gallery": pa.Table.from_pylist(gallery, schema=GALLERY),
               "sampling": pa.Table.from_pylist(sampling, schema=SAMPLING)}
    if not groups:
        yield {"gallery": GALLERY.empty_table(), "sampling": SAMPLING.empty_table()}
