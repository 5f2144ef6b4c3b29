"""Why does GTR+'s 2-component GMM on ŝ flag clean captions? A look inside the fit under
hallucination-style noise.

Inputs as in ``gtr_hallucination.py`` (its teacher-forced q_txt, cached): one noise rate (default
30 %), AdaWeight trained as there, and per seed the last epoch's ŝ = γ·s + (1 − γ)·q_txt (Eq. 7)
with the injected corruptions known. What is measured on that ŝ:

* the paper's rule as trained (the mixture warm-started epoch to epoch, C < 0.5 flagged): the share
  flagged, precision and recall;
* the best any 2-Gaussian rule can do on this ŝ: the "oracle" mixture whose components are the
  Gaussians of the clean and the corrupted pairs and whose weights are their shares, with Eq. 9's
  posterior. If even the oracle flags many clean captions, no fitting can fix the rule on these
  captions. If it does not, the fit is to blame;
* the fit's start: EM from k-means (ours, fresh on the last ŝ), from the oracle, and the best of
  20 random starts, with each fit's mean log-likelihood (does EM leave the oracle for a split of
  the clean pairs, i.e. is that split the likelier 2-Gaussian model?);
* the inputs: the same rule on q_txt alone and on s alone; per caption tier, clean and corrupted
  q_txt (is the clean spread one population, or tiers at different levels?), and a mixture per tier
  (not the paper's: a diagnostic).

It writes a plot of the ŝ histograms with the fitted and oracle components (``--plot``).

    .venv/bin/python experiments/gtr_gmm_separation.py --output /tmp/lf --max-captions 340 [--rate 0.3]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from gtr_hallucination import corrupted_pairs, hallucination_inputs, parser_with_run_options, with_noise
from gtr_noise import detection, train_pairs

from rde.training.gmm_confidence import Mixture1D, clean_confidence, fit_gmm_1d

GAMMA = 0.2  # Eq. 7, the profile's and the paper's Fig. 8


def oracle(x: np.ndarray, noisy: np.ndarray) -> Mixture1D:
    """The mixture whose components are the clean and the corrupted pairs' Gaussians (true shares)."""
    groups = (x[noisy], x[~noisy])
    return Mixture1D(np.array([len(g) / len(x) for g in groups]), np.array([g.mean() for g in groups]),
                     np.array([g.var() for g in groups]), 0, True)


def judged(x: np.ndarray, noisy: np.ndarray, gmm: Mixture1D) -> dict[str, float]:
    """Eq. 9's C under ``gmm``, C < 0.5 flagged: flagged share, precision, recall, the components."""
    order = np.argsort(gmm.means)
    return {**flag_counts(clean_confidence(x, gmm) < 0.5, noisy), "loglik": float(gmm.log_likelihood(x).mean()),
            "means": gmm.means[order].round(3).tolist(), "sds": np.sqrt(gmm.variances[order]).round(3).tolist(),
            "weights": gmm.weights[order].round(2).tolist()}


def random_starts(x: np.ndarray, starts: int = 20, seed: int = 0) -> Mixture1D:
    """The likeliest of ``starts`` EM runs from random means (two values of x), the pooled variance
    and equal weights."""
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(starts):
        means = np.sort(rng.choice(x, size=2, replace=False))
        init = Mixture1D(np.array([0.5, 0.5]), means, np.full(2, x.var()), 0, False)
        fits.append(fit_gmm_1d(x, init=init))
    return max(fits, key=lambda g: float(g.log_likelihood(x).mean()))


def flag_counts(flagged: np.ndarray, noisy: np.ndarray) -> dict[str, float]:
    """The share flagged, and precision and recall of the corrupted pairs among them."""
    return {"flagged": float(flagged.mean()), **detection(flagged, noisy)}


def trained_s_hat(h: Any, noisy: np.ndarray, seed: int, epochs: int, lr: float) -> tuple[np.ndarray, np.ndarray,
                                                                                          np.ndarray]:
    """AdaWeight trained as ``gtr_noise.train_and_evaluate`` does; (ŝ, q_txt, C) of the last epoch's fit."""
    texts, q = with_noise(h.f, h.index, noisy, h.clean_q, h.noisy_q, h.noisy_texts)
    last = train_pairs(h.f, h.index, texts, q, "ada", seed, epochs, lr)[1].epochs[-1]
    return np.asarray(last.s_hat, np.float64), q.astype(np.float64), np.asarray(last.confidence)


def analyse(x: np.ndarray, q: np.ndarray, noisy: np.ndarray, tiers: np.ndarray, confidence: np.ndarray
            ) -> dict[str, Any]:
    s = (x - (1 - GAMMA) * q) / GAMMA  # the raw cosine back from Eq. 7
    flagged = confidence < 0.5
    out: dict[str, Any] = {
        "as trained (warm-started)": flag_counts(flagged, noisy),
        "k-means start, last ŝ": judged(x, noisy, fit_gmm_1d(x)),
        "oracle components": judged(x, noisy, oracle(x, noisy)),
        "EM from the oracle": judged(x, noisy, fit_gmm_1d(x, init=oracle(x, noisy))),
        "best of 20 random starts": judged(x, noisy, random_starts(x)),
        "q_txt alone (k-means start)": judged(q, noisy, fit_gmm_1d(q)),
        "s alone (k-means start)": judged(s, noisy, fit_gmm_1d(s)),
        "oracle on q_txt alone": judged(q, noisy, oracle(q, noisy)),
    }
    per_tier = np.zeros(len(x), bool)
    for t in sorted(set(tiers)):
        m = tiers == t
        if m.sum() >= 10:
            per_tier[m] = clean_confidence(x[m], fit_gmm_1d(x[m])) < 0.5
    out["a mixture per tier (not the paper's)"] = flag_counts(per_tier, noisy)
    out["spread"] = {"sd of γ·s": float(np.std(GAMMA * s)), "sd of (1 − γ)·q_txt": float(np.std((1 - GAMMA) * q)),
                     "clean ŝ": [float(x[~noisy].mean()), float(x[~noisy].std())],
                     "corrupted ŝ": [float(x[noisy].mean()), float(x[noisy].std())],
                     "skew of clean ŝ": float(((x[~noisy] - x[~noisy].mean()) ** 3).mean() / x[~noisy].std() ** 3)}
    def stats(v: np.ndarray) -> list[float] | None:
        return [float(v.mean()), float(v.std())] if len(v) else None

    out["tiers"] = {t: {"pairs": int((tiers == t).sum()), "corrupted": int((noisy & (tiers == t)).sum()),
                        "clean q_txt": stats(q[~noisy & (tiers == t)]),
                        "corrupted q_txt": stats(q[noisy & (tiers == t)]),
                        "flagged by the trained rule": float(flagged[tiers == t].mean())}
                    for t in sorted(set(tiers))}
    return out


def plot(x: np.ndarray, noisy: np.ndarray, tiers: np.ndarray, path: str, rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    bins = np.linspace(x.min(), x.max(), 40)
    grid = np.linspace(x.min(), x.max(), 300)
    ax = axes[0]
    ax.hist([x[~noisy], x[noisy]], bins=bins, stacked=True, label=["clean", "corrupted"], color=["#4c72b0", "#dd8452"])
    width = bins[1] - bins[0]
    for gmm, style, name in ((fit_gmm_1d(x), "-", "fitted (k-means start)"), (oracle(x, noisy), "--", "oracle")):
        dens = np.exp(gmm.log_joint(grid)) * len(x) * width
        for k in range(2):
            ax.plot(grid, dens[:, k], "k" + style, lw=1, label=name if k == 0 else None)
    ax.set_xlabel("ŝ = 0.2·s + 0.8·q_txt (last epoch)")
    ax.set_ylabel("pairs")
    ax.set_title(f"ŝ at {rate:.0%} noise, one seed")
    ax.legend(fontsize=8)
    ax = axes[1]
    names = sorted(set(tiers))
    for k, t in enumerate(names):
        for group, colour, shift in ((~noisy, "#4c72b0", -0.15), (noisy, "#dd8452", 0.15)):
            v = x[group & (tiers == t)]
            ax.scatter(np.full(len(v), k + shift) + np.random.default_rng(k).uniform(-0.07, 0.07, len(v)), v, s=6,
                       color=colour, alpha=0.6)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ŝ")
    ax.set_title("by tier: clean (blue), corrupted (orange)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt_row(name: str, vals: Sequence[dict[str, Any]]) -> str:
    cells = [f"{np.mean([v[k] for v in vals]):.2f}" for k in ("flagged", "precision", "recall")]
    extra = ""
    if "means" in vals[0]:
        v = vals[0]
        extra = (f" | {v['means'][0]:.3f} / {v['means'][1]:.3f} | {v['sds'][0]:.3f} / {v['sds'][1]:.3f} | "
                 f"{v['weights'][0]:.2f} / {v['weights'][1]:.2f} | {np.mean([w['loglik'] for w in vals]):.3f}")
    else:
        extra = " | - | - | - | -"
    return f"| {name} | " + " | ".join(cells) + extra + " |"


def main() -> None:
    parser = parser_with_run_options(__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.3)
    parser.add_argument("--plot", default="docs/results/img/gtr_gmm_separation.png")
    args = parser.parse_args()
    torch.set_num_threads(2)
    h = hallucination_inputs(args)
    runs = []
    for seed in range(args.seeds):
        noisy = corrupted_pairs(h.corruptible, args.rate, seed)
        x, q, conf = trained_s_hat(h, noisy, seed, args.epochs, args.lr)
        runs.append(analyse(x, q, noisy, h.tiers, conf))
        if seed == 0 and args.plot:
            plot(x, noisy, h.tiers, args.plot, args.rate)
    rules = [k for k in runs[0] if k not in ("spread", "tiers")]
    print(f"\n{args.rate:.0%} noise, {args.seeds} seed(s), last epoch's ŝ (seed 0's components shown)\n")
    print("| rule on ŝ | flagged | precision | recall | means (low / high) | sds | weights | mean log-lik |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rules:
        print(fmt_row(r, [run[r] for run in runs]))
    print("\n| spread (seed 0) | value |\n|---|---|")
    for k, v in runs[0]["spread"].items():
        print(f"| {k} | {json.dumps(v) if isinstance(v, list) else f'{v:.3f}'} |")
    print("\n| tier | pairs | corrupted | clean q_txt | corrupted q_txt | flagged by the trained rule |\n"
          "|---|---|---|---|---|---|")
    for t, v in runs[0]["tiers"].items():
        c = v["corrupted q_txt"]
        print(f"| {t} | {v['pairs']} | {v['corrupted']} | {v['clean q_txt'][0]:.3f} ± {v['clean q_txt'][1]:.3f} | "
              + (f"{c[0]:.3f} ± {c[1]:.3f}" if c else "-") + f" | {v['flagged by the trained rule']:.2f} |")


if __name__ == "__main__":
    main()
