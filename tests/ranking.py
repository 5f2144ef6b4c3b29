"""Reference rankings for tests of top-k searches that hold on any CPU.

A search's scores may differ from a float64 reference in their last float32 bits (and a plain
float32 product's differ between CPUs), so comparing its neighbour ids with a reference order is
sound only where no two competing scores are that close: :func:`unambiguous_top` checks this
margin on the data first, then gives the order every correct search must return."""

from __future__ import annotations

import numpy as np

# above any search's score error on the tests' data (unit vectors: ≤ 1e-6; the Gaussian 16-d
# vectors of the top-k tests, scores up to 20: ≤ 3e-6 measured for float32 GEMMs and faiss) and
# far below a typical gap
MARGIN = 1e-5


def reference_scores(queries: np.ndarray, gallery: np.ndarray) -> np.ndarray:
    """Inner products in float64 (each within ~1e-15 of the true value)."""
    return np.asarray(queries, np.float64) @ np.asarray(gallery, np.float64).T


def unambiguous_top(scores: np.ndarray, k: int, margin: float = MARGIN) -> np.ndarray:
    """Each row's k best columns by (higher score, lower column), after asserting that the k + 1
    best scores of every row are at least ``margin`` apart, so that order does not depend on how
    any CPU rounds the last bits."""
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores), axis=1)
    best = np.take_along_axis(scores, order[:, :k + 1], axis=1)
    gaps = -np.diff(best, axis=1)
    assert gaps.size == 0 or gaps.min() >= margin, f"test data has near-ties: smallest gap {gaps.min():.2e}"
    return order[:, :k]
