"""GTR+ adaptive confidence (paper Eq. 6-9): a two-component 1-D Gaussian mixture fitted by EM on
ŝ of every training pair each epoch; a pair's confidence is the posterior of the component with
the larger mean; its loss weight is C^β.

ŝ = γ·s + (1 − γ)·q_txt (Eq. 7) on the raw cosine s, γ = 0.2 as tuned in the paper's Fig. 8.

Pairs without q_txt (captions read from a file, not generated) are our choice, since the paper
always has q_txt: ŝ and s are on different scales, so one mixture over both would mostly
separate the two populations. Each population gets its own mixture instead — ŝ where q_txt is
known, s alone where it is not — and a pair's confidence is the posterior of the higher-mean
component of its own population's fit. A population with fewer than ``min_fit_pairs`` pairs has
no evidence to fit and keeps confidence 1 (weight 1, as before the first fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def combined_score(cosine: np.ndarray, q_txt: np.ndarray, gamma: float = 0.2) -> np.ndarray:
    """ŝ = γ·s + (1 − γ)·q_txt (Eq. 7) on the raw cosine; NaN where q_txt is missing (NaN)."""
    return gamma * np.asarray(cosine, np.float64) + (1.0 - gamma) * np.asarray(q_txt, np.float64)


@dataclass(frozen=True)
class Mixture1D:
    weights: np.ndarray  # α_k
    means: np.ndarray  # μ_k
    variances: np.ndarray  # σ²_k
    iterations: int
    converged: bool

    def log_joint(self, x: np.ndarray) -> np.ndarray:
        """N×K: log α_k + log N(x | μ_k, σ²_k)."""
        x = np.asarray(x, np.float64)[:, None]
        return (np.log(self.weights) - 0.5 * np.log(2 * np.pi * self.variances)
                - 0.5 * (x - self.means) ** 2 / self.variances)

    def posteriors(self, x: np.ndarray) -> np.ndarray:
        return _normalise(self.log_joint(x))[0]

    def log_likelihood(self, x: np.ndarray) -> np.ndarray:
        """Per value: log Σ_k α_k N(x | μ_k, σ²_k) (what EM's stopping rule averages)."""
        return _normalise(self.log_joint(x))[1]


def _normalise(log_joint: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N×K posteriors, N log-likelihoods) from log α_k + log N(x | μ_k, σ²_k), computed stably."""
    top = log_joint.max(axis=1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(log_joint - top).sum(axis=1))
    return np.exp(log_joint - log_norm[:, None]), log_norm


def _kmeans_init(x: np.ndarray, k: int, sample: int = 100_000, iters: int = 20
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """1-D k-means (Lloyd) on an evenly spaced subsample, started at the quantile midpoints:
    means, variances and shares of the clusters, a start that EM needs few iterations from."""
    sub = np.sort(x)[:: max(1, len(x) // sample)]
    means = np.quantile(sub, (np.arange(k) + 0.5) / k)
    for _ in range(iters):
        labels = np.abs(sub[:, None] - means).argmin(axis=1)
        new = np.array([sub[labels == j].mean() if (labels == j).any() else means[j] for j in range(k)])
        if np.allclose(new, means):
            break
        means = new
    labels = np.abs(sub[:, None] - means).argmin(axis=1)
    variances = np.array([sub[labels == j].var() if (labels == j).sum() > 1 else sub.var() for j in range(k)])
    weights = np.array([(labels == j).mean() for j in range(k)])
    return means, variances, np.maximum(weights, 1e-3) / np.maximum(weights, 1e-3).sum()


def fit_gmm_1d(x: np.ndarray, k: int = 2, max_iter: int = 100, tol: float = 1e-6, reg_var: float = 1e-6,
               init: Mixture1D | None = None) -> Mixture1D:
    """EM for a K-component 1-D Gaussian mixture, vectorised over samples (float64). Starts from
    ``init`` (warm start: the previous epoch's fit) or from 1-D k-means on a subsample; stops when
    the mean log-likelihood improves by less than ``tol``."""
    x = np.asarray(x, np.float64).ravel()
    if len(x) < k:
        raise ValueError(f"need at least {k} values to fit {k} components, got {len(x)}")
    if init is not None and len(init.means) == k:
        means, variances, weights = init.means.copy(), init.variances.copy(), init.weights.copy()
    else:
        means, variances, weights = _kmeans_init(x, k)
    variances = np.maximum(variances, reg_var)
    previous, converged, it = -np.inf, False, 0
    for it in range(1, max_iter + 1):
        resp, log_norm = _normalise(Mixture1D(weights, means, variances, it, False).log_joint(x))
        mean_ll = float(log_norm.mean())
        nk = resp.sum(axis=0) + 1e-12
        weights = nk / len(x)
        means = (resp * x[:, None]).sum(axis=0) / nk
        variances = (resp * (x[:, None] - means) ** 2).sum(axis=0) / nk + reg_var
        if mean_ll - previous < tol:
            converged = True
            break
        previous = mean_ll
    return Mixture1D(weights, means, variances, it, converged)


def clean_confidence(x: np.ndarray, gmm: Mixture1D) -> np.ndarray:
    """C (Eq. 9): the posterior of the component with the largest mean."""
    return gmm.posteriors(x)[:, int(np.argmax(gmm.means))]


def confidence_weights(confidence: np.ndarray, beta: float = 0.8) -> np.ndarray:
    """C^β, the per-pair loss weights of Eq. 10-11."""
    return np.power(np.clip(confidence, 0.0, 1.0), beta)


@dataclass(frozen=True)
class ConfidenceFit:
    """One epoch's fits: on ŝ for pairs with q_txt, on s for pairs without (None: not fitted)."""

    with_q_txt: Mixture1D | None
    cosine_only: Mixture1D | None

    def state(self) -> dict[str, Any]:
        """The fits as plain lists and numbers (a checkpoint loads them with ``weights_only``)."""
        return {name: None if fit is None else {"weights": fit.weights.tolist(), "means": fit.means.tolist(),
                                                "variances": fit.variances.tolist(), "iterations": fit.iterations,
                                                "converged": fit.converged}
                for name, fit in (("with_q_txt", self.with_q_txt), ("cosine_only", self.cosine_only))}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> ConfidenceFit | None:
        if state is None:
            return None

        def mixture(d: dict[str, Any] | None) -> Mixture1D | None:
            return None if d is None else Mixture1D(np.asarray(d["weights"]), np.asarray(d["means"]),
                                                     np.asarray(d["variances"]), d["iterations"], d["converged"])
        return cls(mixture(state["with_q_txt"]), mixture(state["cosine_only"]))

    @property
    def iterations(self) -> list[int]:
        """EM iterations of each fit made (a warm start needs fewer)."""
        return [f.iterations for f in (self.with_q_txt, self.cosine_only) if f is not None]


def pair_confidence(cosine: np.ndarray, q_txt: np.ndarray, gamma: float = 0.2, k: int = 2,
                    previous: ConfidenceFit | None = None, min_fit_pairs: int = 10
                    ) -> tuple[np.ndarray, np.ndarray, ConfidenceFit]:
    """(C per pair (Eq. 9), the score each pair was judged on, the fits): ŝ (Eq. 7) and its own
    mixture where q_txt is known, s and a separate mixture where it is not (see the module note);
    ``previous`` warm-starts each fit from the last epoch's."""
    cosine = np.asarray(cosine, np.float64)
    q_txt = np.asarray(q_txt, np.float64)
    has_q = ~np.isnan(q_txt)
    score = np.where(has_q, combined_score(cosine, np.where(has_q, q_txt, 0.0), gamma), cosine)
    confidence = np.ones(len(score))
    fits: list[Mixture1D | None] = []
    for mask, init in ((has_q, previous and previous.with_q_txt), (~has_q, previous and previous.cosine_only)):
        if mask.sum() < max(k, min_fit_pairs):
            fits.append(None)
            continue
        gmm = fit_gmm_1d(score[mask], k=k, init=init)
        confidence[mask] = clean_confidence(score[mask], gmm)
        fits.append(gmm)
    return confidence, score, ConfidenceFit(fits[0], fits[1])
