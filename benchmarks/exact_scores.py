"""Exact top-K scores that are the same bits on any CPU (``rde.common.topk.inner_products``: each
row on a fixed-point grid of its own, products summed exactly in float64) against the plain
float32 GEMM they replaced, side by side in one run: the time ratio of the two score matrices and
of a whole top-K search, how far each is from float64, and whether blocked and whole products give
the same bits.

Data: unit vectors (Gaussian, normalised), ``--dim`` 1280 (EfficientNet-Lite0 pooled, the hard
negatives' and CGDS's vectors) and 384 (MiniLM, the text side), queries × gallery as given.
Each arm runs ``--repeats`` times alternating; the median is printed.

    .venv/bin/python benchmarks/exact_scores.py [--queries 2048] [--gallery 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rde.common.topk import inner_products, topk_exact


def unit(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def float32_topk(queries: np.ndarray, gallery: np.ndarray, k: int, block: int = 65_536) -> np.ndarray:
    """The former exact search's arithmetic: float32 GEMM per gallery block, argpartition merge."""
    best = np.zeros((len(queries), 0), np.float32)
    for at in range(0, len(gallery), block):
        cand = np.concatenate([best, queries @ gallery[at:at + block].T], axis=1)
        best = np.take_along_axis(cand, np.argpartition(-cand, k - 1, axis=1)[:, :k], axis=1)
    return best


def median_seconds(arms: dict[str, callable], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--gallery", type=int, default=20_000)
    parser.add_argument("--dims", type=int, nargs="+", default=[1280, 384])
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| dim | queries × gallery | scores: exact / float32 s | ratio | top-K: exact / float32 s | ratio "
          "| max error vs float64: exact / float32 | blocked = whole: exact / float32 |")
    print("|---|---|---|---|---|---|---|---|")
    for dim in args.dims:
        q, g = unit(args.queries, dim, seed=1), unit(args.gallery, dim, seed=2)
        t = median_seconds({"exact": lambda q=q, g=g: inner_products(q, g), "float32": lambda q=q, g=g: q @ g.T,
                            "exact_topk": lambda q=q, g=g: topk_exact(q, g, args.k),
                            "float32_topk": lambda q=q, g=g: float32_topk(q, g, args.k)}, args.repeats)
        qs, sub = q[:256], g[:2000]
        reference = qs.astype(np.float64) @ sub.astype(np.float64).T
        err_exact = float(np.abs(inner_products(qs, sub) - reference).max())
        err_plain = float(np.abs(qs @ sub.T - reference).max())
        same_exact = np.array_equal(np.concatenate([inner_products(qs[a:a + 7], sub) for a in range(0, 256, 7)]),
                                    inner_products(qs, sub))
        same_plain = np.array_equal(np.concatenate([qs[a:a + 7] @ sub.T for a in range(0, 256, 7)]), qs @ sub.T)
        print(f"| {dim} | {args.queries} × {args.gallery} | {t['exact']:.3f} / {t['float32']:.3f} "
              f"| {t['exact'] / t['float32']:.2f} | {t['exact_topk']:.3f} / {t['float32_topk']:.3f} "
              f"| {t['exact_topk'] / t['float32_topk']:.2f} | {err_exact:.1e} / {err_plain:.1e} "
              f"| {same_exact} / {same_plain} |")


if __name__ == "__main__":
    main()
