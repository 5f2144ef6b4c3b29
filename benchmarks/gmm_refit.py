"""GMM refit time (GTR+ refits a 2-component 1-D GMM on every training pair's ŝ each epoch):
our vectorised EM (cold, and warm-started from the previous fit as train-gtr does each epoch)
against scikit-learn's GaussianMixture on the same synthetic 3.6M values (LargeFine-Person's pair
count), side by side in one run; also the fitted means.

    .venv/bin/python benchmarks/gmm_refit.py [--pairs 3600000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from sklearn.mixture import GaussianMixture

from rde.training.gmm_confidence import fit_gmm_1d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3_600_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    noisy = int(0.3 * args.pairs)
    x = np.concatenate([rng.normal(0.45, 0.06, noisy), rng.normal(0.72, 0.07, args.pairs - noisy)])
    rng.shuffle(x)
    drifted = x + rng.normal(0.01, 0.005, len(x))  # the next epoch: scores moved a little
    ours_t, warm_t, sk_t = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ours = fit_gmm_1d(x, tol=1e-6, max_iter=100)
        ours_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        warm = fit_gmm_1d(drifted, tol=1e-6, max_iter=100, init=ours)
        warm_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        sk = GaussianMixture(2, tol=1e-6, max_iter=100, random_state=0).fit(x[:, None])
        sk_t.append(time.perf_counter() - start)
    o, w, s = statistics.median(ours_t), statistics.median(warm_t), statistics.median(sk_t)
    print(f"{args.pairs:,} values, 2 components, tol 1e-6 (median of {args.repeats}):")
    print("\n| fit | seconds | iterations | means |\n|---|---|---|---|")
    print(f"| ours (vectorised EM) | {o:.2f} | {ours.iterations} | {np.sort(ours.means).round(4).tolist()} |")
    print(f"| ours, warm start from the previous epoch's fit | {w:.2f} | {warm.iterations} | "
          f"{np.sort(warm.means).round(4).tolist()} |")
    print(f"| scikit-learn GaussianMixture | {s:.2f} | {sk.n_iter_} | {np.sort(sk.means_.ravel()).round(4).tolist()} |")
    print(f"\nratio ours / scikit-learn: {o / s:.2f} (cold), {w / s:.2f} (warm start, as train-gtr refits)")


if __name__ == "__main__":
    main()
