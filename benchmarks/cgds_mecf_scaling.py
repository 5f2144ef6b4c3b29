"""CGDS clustering + sampling and MECF top-K on synthetic embeddings: ours vs faiss, same run.

Sizes N × 768 (float32, L2-normalised, 100 planted clusters). For each N:
* k-means (K=100): ``rde.secmm.cgds.kmeans_clusters`` as configured by default (``auto``: scikit-learn,
  MiniBatchKMeans above 20k) vs plain ``faiss.Kmeans`` (20 iterations, random seeds), with both
  inertias (sum of squared distances to the nearest centroid: lower is better), plus sampling;
* top-K (K=1000, 100 queries): ``rde.common.topk.topk_exact`` (blocked numpy matmul + argpartition)
  vs ``faiss.IndexFlatIP`` search; then the union of two "experts".
Prints seconds, the ratio ours/faiss, and the scaling exponent b of time ∝ N^b (log-log fit).

``--streaming N DIM`` (alone: ``--sizes`` with no value skips the scaling rows) compares, on N × DIM
vectors with 100 planted clusters, the in-memory MiniBatchKMeans (``kmeans_clusters`` with
``sklearn-minibatch``: what ``auto`` used above 20k before) with ``kmeans_streaming`` (what CGDS runs
above ``sampling.minibatch_above``), its vectors given in blocks of 10k rows, in the pool's order
twice: shuffled, and sorted by cluster (a pool in shard order, crops of one video together).
Prints seconds and each inertia over in-memory KMeans' (K=100, 3 tries: the reference).

    .venv/bin/python benchmarks/cgds_mecf_scaling.py [--sizes 10000 100000 1000000]
    .venv/bin/python benchmarks/cgds_mecf_scaling.py --sizes --streaming 100000 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from models.backends.disk_memo import keep_nothing_on_disk
from rde.common.topk import topk_exact, topk_faiss
from rde.secmm.cgds import kmeans_clusters, kmeans_streaming, sample_per_cluster
from rde.secmm.mecf import union_candidates


def synthetic(n: int, dim: int, seed: int, with_labels: bool = False):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(100, dim)).astype(np.float32)
    labels = rng.integers(0, 100, n)
    x = centers[labels] + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return (x, labels) if with_labels else x


def streaming_vs_in_memory(n: int, dim: int, k: int = 100, block: int = 10_000) -> None:
    """In-memory MiniBatchKMeans vs the streaming k-means (blocks of ``block`` rows), shuffled and
    in cluster order; inertia relative to in-memory KMeans (the reference)."""
    from sklearn.cluster import KMeans

    x, labels = synthetic(n, dim, 0, with_labels=True)
    t_ref, ref = timed(lambda: KMeans(n_clusters=k, random_state=0, n_init=3).fit(x))
    t_mb, mb = timed(kmeans_clusters, x, k, 0, "sklearn-minibatch")
    print(f"N={n} dim={dim} K={k}: KMeans in memory {t_ref:.1f}s (inertia 1) | MiniBatchKMeans in memory "
          f"{t_mb:.1f}s, inertia x{mb.inertia / ref.inertia_:.4f}", flush=True)
    for order_name, order in (("shuffled", np.arange(n)), ("cluster order", np.argsort(labels, kind="stable"))):
        rows = x[order]
        t_st, st = timed(kmeans_streaming, lambda rows=rows: (rows[a:a + block] for a in range(0, n, block)), k, 0)
        print(f"  streaming, {order_name}: {t_st:.1f}s, inertia x{st.inertia / ref.inertia_:.4f} "
              f"(in-memory MiniBatchKMeans x{mb.inertia / ref.inertia_:.4f}); holds {block} + "
              f"{min(n, 256 * k)} rows, not {n}", flush=True)


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
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--streaming", type=int, nargs=2, metavar=("N", "DIM"),
                        help="also compare in-memory MiniBatchKMeans with the streaming k-means on N × DIM")
    args = parser.parse_args()
    if args.streaming:
        streaming_vs_in_memory(*args.streaming)
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
    if not rows:
        return
    sizes = [r[0] for r in rows]
    b = {name: exponent(sizes, [r[i] for r in rows]) for name, i in
         (("kmeans ours", 1), ("kmeans faiss", 2), ("top-K ours", 5), ("top-K faiss", 6))}
    print("scaling exponent b (time ∝ N^b): " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()))


if __name__ == "__main__":
    main()
