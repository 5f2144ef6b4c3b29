"""The approximate top-K index (faiss IVF-Flat, ``rde.common.topk.topk_ivf``) against exact blocked
search on the same data, same run: recall@10 and recall@K and seconds, by ``nprobe``.

Data: N × 768 float32, L2-normalised, drawn from a Gaussian mixture (centres N(0, 1), noise σ 0.5
per dimension), in two structures: ``coarse`` (100 clusters: neighbours inside a big cluster are
decided by the noise, the hard case for an index) and ``identities`` (N/50 clusters of ~50, like
surveillance identities). Queries are further draws of the same mixture, not in the gallery: 200
(MECF: a few hundred text queries) and, with ``--many``, N/5 (hard negatives: every image asks).
Synthetic, so the recall here chooses defaults; ``search`` measures recall on every real call
(``retrieval.ann.check_queries``) and falls back to exact search below ``min_recall``.

    .venv/bin/python benchmarks/ann_recall.py [--sizes 10000 100000] [--k 50]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rde.common.topk import AnnSpec, ivf_lists, recall_at_k, topk_exact, topk_ivf


def mixture(n: int, n_queries: int, dim: int, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim)).astype(np.float32)

    def draw(m: int) -> np.ndarray:
        x = centres[rng.integers(0, clusters, m)] + 0.5 * rng.normal(size=(m, dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return draw(n_queries), draw(n)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--many", action="store_true", help="N/5 queries instead of 200")
    args = parser.parse_args()
    print("| structure | N | queries | nlist | nprobe | recall@10 | recall@K | exact s | ivf s (build + search) "
          "| ivf/exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        n_queries = n // 5 if args.many else 200
        for structure, clusters in (("coarse", 100), ("identities", max(2, n // 50))):
            queries, gallery = mixture(n, n_queries, args.dim, clusters, seed=n + clusters)
            t_exact, (exact, _) = timed(topk_exact, queries, gallery, args.k)
            for nprobe in args.nprobe:
                spec = AnnSpec(nprobe=nprobe)
                t_ivf, (found, _) = timed(topk_ivf, queries, gallery, args.k, spec)
                nlist = ivf_lists(n, spec)
                r10, r_k = recall_at_k(found[:, :10], exact[:, :10]), recall_at_k(found, exact)
                print(f"| {structure} | {n} | {n_queries} | {nlist} | {nprobe} | {r10:.4f} | {r_k:.4f} | "
                      f"{t_exact:.2f} | {t_ivf:.2f} | {t_ivf / t_exact:.2f} |", flush=True)


if __name__ == "__main__":
    main()
