"""The engine's ranking (``rde.evaluation.streamed_ranking``) over a whole score matrix, as the
metric tests hand it rankings: where each query's relevant items land and which items lead.

A query's row of scores ranks every item of its gallery by score, highest first, ties broken by
gallery order (the lower column first): a stable order, the same as ``np.argsort(-row,
kind="stable")``, so a retriever that gives many items the same score cannot win by luck of the
sort. A score of ``-inf`` marks an item the retriever did not rank at all (e.g. outside the
candidates it returned): such an item is never a hit.

The matrix is handed to ``streamed_ranking.rank_blocks`` as one block, so the tests that compare
it with ``np.argsort`` and trec_eval check the production ranking itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from rde.evaluation.streamed_ranking import rank_blocks


@dataclass(frozen=True)
class RankedChunk:
    """The ranking of a chunk of queries, one entry per query in the order given.

    ``positions[i]``: the sorted 1-based ranks, in the full ranking, of query i's relevant items
    that were ranked (an unranked, ``-inf`` item is absent, so there may be fewer than R).
    ``top_idx[i]``/``top_scores[i]``: the gallery columns of its first min(top_n, G) items and
    their scores, best first, without unranked items (so possibly fewer).
    """

    positions: list[np.ndarray]
    top_idx: list[np.ndarray]
    top_scores: list[np.ndarray]


def rank_scores(scores: np.ndarray, relevant: Sequence[np.ndarray], top_n: int = 100) -> RankedChunk:
    """Rank each row of the Q × G ``scores`` (see the module docstring for the order) and return
    the ranks of the columns in ``relevant[i]`` and the top ``top_n`` columns of each row. NaN
    scores are rejected: they have no place in an order."""
    matrix = _as_scores(scores)
    if len(relevant) != matrix.shape[0]:
        raise ValueError(f"{matrix.shape[0]} rows of scores but {len(relevant)} lists of relevant items")
    if top_n < 0:
        raise ValueError(f"top_n must be ≥ 0, got {top_n}")
    columns = np.arange(matrix.shape[1])
    names = [str(c) for c in columns]

    def block(only: set[str] | None) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
        keep = columns if only is None else np.array(sorted(int(c) for c in only), dtype=np.int64)
        yield [names[c] for c in keep], keep, matrix[:, keep]

    wanted = [{str(c) for c in _as_columns(rel, matrix.shape[1])} for rel in relevant]
    rankings = rank_blocks(block, wanted, top_n) if top_n else rank_blocks(block, wanted, 1)
    return RankedChunk([np.asarray(r.positions, dtype=np.int64) for r in rankings],
                       [np.asarray([int(i) for i in r.top_ids[:top_n]], dtype=np.int64) for r in rankings],
                       [np.asarray(r.top_scores[:top_n], dtype=matrix.dtype) for r in rankings])


def _as_scores(scores: np.ndarray) -> np.ndarray:
    """A 2-D floating array of scores (integers become float64), with no NaN."""
    matrix = np.asarray(scores)
    if not np.issubdtype(matrix.dtype, np.floating):
        matrix = matrix.astype(np.float64)
    if matrix.ndim != 2:
        raise ValueError(f"scores must be queries × gallery, got shape {matrix.shape}")
    if np.isnan(matrix).any():
        raise ValueError("scores contain NaN: mark an unranked item with -inf")
    return matrix


def _as_columns(relevant: np.ndarray, width: int) -> np.ndarray:
    """Distinct relevant gallery columns as int64, checked to lie in [0, width)."""
    columns = np.unique(np.asarray(relevant, dtype=np.int64))
    if columns.size and (columns[0] < 0 or columns[-1] >= width):
        raise ValueError(f"relevant columns must lie in [0, {width}), got {columns[0]}..{columns[-1]}")
    return columns
