"""Near-duplicate filter of the denoised pool, per domain (SemDeDup-style).

Why: a surveillance video gives many crops of one person a few frames apart, nearly the same
image. They add little to a gallery (CGDS would draw several of one look) and make a query's
relevant set ambiguous. This filter keeps one image of each group of near-identical ones.

How (after SemDeDup: Abbas et al. 2023, "SemDeDup: Data-efficient learning at web-scale through
semantic deduplication", arXiv:2303.09540, which clusters the embeddings with k-means, then
removes, within each cluster, items whose pairwise cosine exceeds 1 - eps): within each domain,
the images are split into clusters, and within a cluster a greedy pass visits the images from
sharpest to least sharp (``laplacian_variance`` descending; ties: ``image_id`` ascending, then
input position). An image is kept unless its cosine to an already kept image of its cluster is
*above* the threshold (equal is kept); then it is dropped, and its twin is the kept image with
the highest cosine to it (ties: the smallest ``image_id``). So the image kept of a group is its
sharpest, where SemDeDup keeps the one farthest from the cluster centroid: here the copies differ
in blur and crop, not in content.

Clusters: a domain of at most ``cluster_size`` images is one cluster, every pair compared. A
larger one is split by k-means (scikit-learn ``KMeans``, ``ceil(n / cluster_size)`` clusters,
seeded, ``KMEANS_INITS`` starts) on the normalised vectors, and only pairs within a cluster are
compared: near-identical vectors almost always share a cluster, and a pair split across two is
missed (the price of not comparing n² pairs).

Determinism: vectors are L2-normalised and compared in float64, cosines clipped to [-1, 1] (so a
threshold of 1.0 drops nothing), ties broken by ``image_id``, k-means seeded and run on at most
two OpenMP threads (``rde.common.openmp_threads``). A zero vector stays zero: cosine 0 to
everything, always kept.

Memory: one domain's vectors at a time (n × dim float64) plus one block of cosines
(``BLOCK`` × the images kept so far in the cluster); never the pool's vectors, never an n × n
matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from models.specs import Strict
from rde.common.declarations import profile_section
from rde.common.openmp_threads import at_most_two_openmp_threads
from rde.common.reasons import Reason, declare_reason

BLOCK = 512  # images of a cluster compared to the kept ones in one matrix product
KMEANS_INITS = 3  # k-means starts (n_init), fixed: part of what the stage's version stands for

Take = Callable[[np.ndarray], np.ndarray]  # row positions → their vectors (rows × dim), in that order

# DAP's code for a query too close to a kept one, reused: what it means for an image
NEAR_DUPLICATE = declare_reason(Reason.NEAR_DUPLICATE, "near-duplicates", "an image whose embedding cosine to a "
                                "sharper kept image of its domain is above near_duplicates.threshold (detail names it)")


@profile_section("near_duplicates", "The near-duplicate filter (build-secmm): of near-identical crops, only the "
                 "sharpest is kept.")
class NearDuplicateSpec(Strict):
    """The near-duplicate filter of the denoised pool (SemDeDup-style, ``rde/secmm/near_duplicates.py``):
    within each domain, an image whose image-embedding cosine to a sharper kept image of its cluster
    is above ``threshold`` is rejected as ``near_duplicate``, naming that kept image."""

    threshold: float = Field(0.95, gt=0.0, le=1.0, description="Cosine (of L2-normalised image embeddings) "
                             "above which an image is a near duplicate of a kept one and is rejected; a cosine "
                             "equal to it is kept, and 1.0 keeps every image.")
    cluster_size: int = Field(1000, ge=2, description="A domain of at most this many images is compared pair "
                              "by pair; a larger one is split by k-means into ceil(images / cluster_size) "
                              "clusters, compared within each (a pair split across two clusters is missed).")
    seed: int = Field(0, description="Seed of that k-means clustering.")


@dataclass(frozen=True)
class Decision:
    """What became of one input row: kept (``twin`` is None) or dropped as a near duplicate of the
    kept image ``twin``, at ``cosine`` to it. ``cluster`` is its cluster within its domain."""

    image_id: str
    domain: str
    cluster: int
    twin: str | None = None
    cosine: float | None = None

    @property
    def kept(self) -> bool:
        return self.twin is None


@dataclass(frozen=True)
class DomainCount:
    """One domain's counts: images in, clusters compared within, kept, dropped."""

    domain: str
    images: int
    clusters: int
    kept: int
    dropped: int


@dataclass
class Deduplication:
    """The filter's result: one decision per input row, in input order, and counts per domain."""

    decisions: list[Decision]
    by_domain: list[DomainCount]

    @property
    def dropped(self) -> int:
        return sum(not d.kept for d in self.decisions)


def normalised(vectors: np.ndarray) -> np.ndarray:
    """The rows L2-normalised, in float64 (a zero row stays zero)."""
    x = np.asarray(vectors, dtype=np.float64)
    norms = np.sqrt((x * x).sum(axis=1, keepdims=True))
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)


def keep_order(image_ids: Sequence[str], sharpness: Sequence[float | None]) -> list[int]:
    """Positions from sharpest to least sharp; ties by image id, then position. A missing or NaN
    sharpness counts as the least sharp."""
    def key(p: int) -> tuple[float, str, int]:
        s = sharpness[p]
        return (-s if s is not None and not math.isnan(s) else math.inf, image_ids[p], p)

    return sorted(range(len(image_ids)), key=key)


def greedy_keep(image_ids: Sequence[str], sharpness: Sequence[float | None], unit: np.ndarray,
                threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The greedy pass over one cluster (``unit``: its normalised vectors): per position, the
    position of its kept twin (-1: kept) and the cosine to it (NaN: kept). Cosines are computed a
    ``BLOCK`` of images at a time against the images kept before the block and within it."""
    n = len(image_ids)
    twin, cosine = np.full(n, -1, np.int64), np.full(n, np.nan)
    kept: list[int] = []  # positions, in the order kept
    order = keep_order(image_ids, sharpness)
    for start in range(0, n, BLOCK):
        block = order[start:start + BLOCK]
        x = unit[block]
        before = np.clip(x @ unit[kept].T, -1.0, 1.0) if kept else np.zeros((len(block), 0))
        within = np.clip(x @ x.T, -1.0, 1.0)
        here: list[int] = []  # indices into block of the images kept in this block
        for j, pos in enumerate(block):
            candidates = kept + [block[i] for i in here]
            scores = np.concatenate([before[j], within[j, here]])
            best = float(scores.max()) if len(scores) else -math.inf
            if best > threshold:
                twin[pos] = min((c for c, s in zip(candidates, scores, strict=True) if s == best),
                                key=lambda c: (image_ids[c], c))
                cosine[pos] = best
            else:
                here.append(j)
        kept += [block[i] for i in here]
    return twin, cosine


def cluster_labels(unit: np.ndarray, cluster_size: int, seed: int) -> np.ndarray:
    """A cluster per row: all 0 for at most ``cluster_size`` rows, else seeded k-means into
    ``ceil(n / cluster_size)`` clusters."""
    n = len(unit)
    if n <= cluster_size:
        return np.zeros(n, np.int64)
    from sklearn.cluster import KMeans  # here: sklearn costs a process ~2 s to import

    model = KMeans(n_clusters=math.ceil(n / cluster_size), random_state=seed, n_init=KMEANS_INITS)
    with at_most_two_openmp_threads():
        return model.fit_predict(unit).astype(np.int64)


def find_near_duplicates(image_ids: Sequence[str], domains: Sequence[str], sharpness: Sequence[float | None],
                         vectors: np.ndarray | Take, spec: NearDuplicateSpec) -> Deduplication:
    """Decide every row (see the module docstring). ``vectors``: the rows' embeddings, or a
    function from row positions to their vectors (the embedding cache's ``take``), called once per
    domain, so only one domain's vectors are held at a time."""
    take: Take = vectors if callable(vectors) else np.asarray(vectors).__getitem__
    decisions: dict[int, Decision] = {}  # row position → its decision
    counts: list[DomainCount] = []
    domain_of = np.asarray(domains, dtype=object)
    for domain in sorted(set(domains)):
        rows = np.flatnonzero(domain_of == domain)
        unit = normalised(take(rows))
        labels = cluster_labels(unit, spec.cluster_size, spec.seed)
        dropped = 0
        for cluster in np.unique(labels):
            members = rows[labels == cluster]
            ids = [image_ids[p] for p in members]
            twin, cosine = greedy_keep(ids, [sharpness[p] for p in members], unit[labels == cluster],
                                       spec.threshold)
            for i, p in enumerate(members):
                decisions[int(p)] = Decision(ids[i], domain, int(cluster)) if twin[i] < 0 else \
                    Decision(ids[i], domain, int(cluster), ids[twin[i]], float(cosine[i]))
            dropped += int((twin >= 0).sum())
        counts.append(DomainCount(domain, len(rows), len(np.unique(labels)), len(rows) - dropped, dropped))
    return Deduplication([decisions[p] for p in range(len(image_ids))], counts)
