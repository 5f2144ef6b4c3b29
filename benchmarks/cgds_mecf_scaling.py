"""CGDS clustering + sampling and MECF top-K on synthetic embeddings: ours vs faiss, same run.

Sizes N × 768 (float32, L2-normalised, 100 planted clusters). For each N:
* k-means (K=100): ``rde.secmm.cgds.kmeans_clusters`` as configured by default (``auto``: scikit-learn,
  MiniBatchKMeans above 20k) vs plain ``faiss.Kmeans`` (20 iterations, random seeds), with both
  inertias (sum of squared distances to the nearest centroid: lower is better), plus sampling;
* top-K (K=1000, 100 queries): ``rde.common.topk.topk_exact`` (blocked numpy matmul + argpartition)
  vs ``faiss.IndexFlatIP`` search; then the union of two "experts".
Prints seconds, the ratio ours/faiss, and the scaling exponent b of time ∝ N^b (log-log fit).

    .venv/bin/python benchmarks/cgds_mecf_scaling.py [--sizes 10000 100000 1000000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rde.common.topk import topk_exact, topk_faiss
from rde.secmm.cgds import kmeans_clusters, sample_per_cluster
from rde.secmm.mecf import union_candidates


def synthetic(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(100, dim)).astype(np.float32)
    x = centers[rng.integers(0, 100, n)] + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def faiss_kmeans(x: np.ndarray, k: int) -> float:
    """Plain faiss k-means; returns its inertia."""
    import faiss

    km = faiss.Kmeans(x.shape[1], k, niter=20, seed=0, verbose=False)
    km.train(x)
    dist, _ = km.index.search(x, 1)
    return float(dist.sum())


def exponent(sizes: list[int], times: list[float]) -> float:
    return float(np.polyfit(np.log(sizes), np.log(times), 1)[0]) if len(sizes) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=768)
    args = parser.parse_args()
    rows = []
    for n in args.sizes:
        x = synthetic(n, args.dim, 0)
        q = synthetic(100, args.dim, 1)
        t_km, clusters = timed(kmeans_clusters, x, 100, seed=0)
        t_fk, ref_inertia = timed(faiss_kmeans, x, 100)
        t_sample, picked = timed(sample_per_cluster, clusters.labels, 100, 1000, seed=0)
        t_top, (a_idx, a_val) = timed(topk_exact, q, x, 1000)
        t_ftop, (f_idx, _) = timed(topk_faiss, q, x, 1000)
        same = float(np.mean([len(set(a) & set(b)) / 1000 for a, b in zip(a_idx, f_idx, strict=True)]))
        b_idx, b_val = topk_exact(q[::-1].copy(), x, 1000)
        t_union, union = timed(union_candidates, {"a": (a_idx, a_val), "b": (b_idx, b_val)})
        rows.append((n, t_km, t_fk, t_sample, len(picked), t_top, t_ftop, same, t_union, len(union)))
        print(f"N={n:>8}: kmeans ours {t_km:7.2f}s faiss {t_fk:7.2f}s (x{t_km / t_fk:5.2f}; inertia "
              f"ours/faiss {clusters.inertia / ref_inertia:.3f}) | sample {t_sample:.3f}s "
              f"({len(picked)} kept) | top-1000 ours {t_top:6.2f}s faiss {t_ftop:6.2f}s (x{t_top / t_ftop:5.2f}, "
              f"overlap {same:.3f}) | union {t_union:.2f}s ({len(union)} pairs)", flush=True)
        del x
    sizes = [r[0] for r in rows]
    b = {name: exponent(sizes, [r[i] for r in rows]) for name, i in
         (("kmeans ours", 1), ("kmeans faiss", 2), ("top-K ours", 5), ("top-K faiss", 6))}
    print("scaling exponent b (time ∝ N^b): " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()))


if __name__ == "__main__":
    main()
