"""Centroid-Guided Diversity Sampling (DSMM-TBIR, Sec. 3.1 / App. A).

Embeddings of one domain's pool are clustered with k-means (K≈100 per domain in production);
from each cluster n images are drawn at random, n uniform in [min, max] and at most the
cluster's size. Drawing per cluster (not from the whole pool) keeps rare looks represented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rde.common.profiles import SamplingSpec


@dataclass
class Clustering:
    labels: np.ndarray  # cluster id per item
    centroids: np.ndarray
    inertia: float


def kmeans_clusters(vectors: np.ndarray, k: int, seed: int, backend: str = "auto",
                    minibatch_above: int = 20_000) -> Clustering:
    """k-means on L2-normalised vectors; K is capped at the number of items.

    ``backend``: ``sklearn`` (Lloyd KMeans, k-means++ init, 3 inits), ``sklearn-minibatch``
    (MiniBatchKMeans, 3 inits), ``faiss`` (k-means++ seeds from a 256-per-centroid subsample, then
    20 faiss iterations and a nearest-centroid assignment of every point), or ``auto`` = sklearn
    below ``minibatch_above`` items, sklearn-minibatch above.

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
    from sklearn.cluster import KMeans, MiniBatchKMeans  # here: sklearn costs every process ~2 s to import

    if backend == "sklearn-minibatch" or (backend == "auto" and n > minibatch_above):
        model = MiniBatchKMeans(n_clusters=k, random_state=seed, batch_size=4096, n_init=3)
    else:
        model = KMeans(n_clusters=k, random_state=seed, n_init=3)
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
    out = GallerySample()
    for domain in sorted({r["domain"] for r in rows}):
        idx = np.array([i for i, r in enumerate(rows) if r["domain"] == domain])
        clusters = kmeans_clusters(vectors[idx], spec.clusters_per_domain, spec.seed, spec.kmeans_backend,
                                   spec.minibatch_above)
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
