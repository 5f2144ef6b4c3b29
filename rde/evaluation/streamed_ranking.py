"""Ranking every query against a gallery that arrives in blocks, in memory bounded by one block.

A query's metrics need two things of its full ranking: the rank of each of its relevant items and,
for the run file and the report, its top ``top_n`` items. Both are computed block by block without
ever holding the whole score matrix:

1. the relevant items' scores, from the blocks restricted to the relevant items (``only``);
2. every block's scores: for each relevant item j, the items scoring above it and the items scoring
   the same that come earlier in gallery order are counted, so its rank is
   ``1 + #{s > s_j} + #{k < j : s_k = s_j}``: ties go to gallery order, as a stable sort would. The
   count sorts the block's row once and binary-searches the relevant scores in it (O(B log B) per
   query and block, whatever the number of relevant items); the rare exact ties are counted apart.
   The top ``top_n`` are merged with the block's by a stable sort (earlier items first on a tie).

An item scored ``-inf`` was not ranked by the retriever (a scores file that leaves it out): it is
never in the top, and a relevant item at ``-inf`` has no rank. Scores must not be NaN or ``+inf``
(the vector checks and the scores-file reader refuse them). Scores from vectors are
``rde.common.topk.inner_products``, the same bits in any block shape, so a streamed ranking equals
a whole one exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

# blocks(only): per block in gallery order, (item ids, their 0-based positions in the gallery, the
# Q × len(ids) scores); with ``only``, just the rows of those items
ScoreBlocks = Callable[[set[str] | None], Iterator[tuple[list[str], np.ndarray, np.ndarray]]]


@dataclass(frozen=True)
class QueryRanking:
    """One query's ranking: the sorted 1-based ranks of its relevant items that were ranked, the
    number of its relevant items, and its top items (ids and scores, best first)."""

    positions: tuple[int, ...]
    n_relevant: int
    top_ids: tuple[str, ...]
    top_scores: tuple[float, ...]

    @property
    def first_hit(self) -> int | None:
        return self.positions[0] if self.positions else None


def rank_blocks(blocks: ScoreBlocks, relevant: Sequence[set[str]], top_n: int = 100) -> list[QueryRanking]:
    """Rank ``len(relevant)`` queries over the gallery ``blocks`` yields (module docstring)."""
    thresholds, indices = _relevant_scores(blocks, relevant)
    above = [np.zeros(len(s), dtype=np.int64) for s in thresholds]
    top_scores = np.full((len(relevant), 0), -np.inf)
    top_index = np.zeros((len(relevant), 0), dtype=np.int64)
    names: dict[int, str] = {}
    for ids, position, scores in blocks(None):
        scores = np.asarray(scores, dtype=np.float64)
        position = np.asarray(position, dtype=np.int64)
        for q, row in enumerate(scores):
            if len(thresholds[q]):
                above[q] += _ahead_in_block(row, position, thresholds[q], indices[q])
        top_scores, top_index = _merge_top(top_scores, top_index, scores, position, top_n)
        kept = set(top_index.ravel().tolist())
        names = {i: n for i, n in names.items() if i in kept}
        names.update({int(p): n for p, n in zip(position, ids, strict=True) if int(p) in kept})
    return [QueryRanking(tuple(sorted(int(a) + 1 for a in above[q])), len(relevant[q]),
                         tuple(names[i] for i, s in zip(top_index[q], top_scores[q], strict=True) if s != -np.inf),
                         tuple(float(s) for s in top_scores[q] if s != -np.inf))
            for q in range(len(relevant))]


def _relevant_scores(blocks: ScoreBlocks, relevant: Sequence[set[str]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each query's ranked relevant items: their scores and gallery positions (pass 1)."""
    scores: list[list[float]] = [[] for _ in relevant]
    where: list[list[int]] = [[] for _ in relevant]
    wanted = set().union(*relevant) if relevant else set()
    for ids, position, block in blocks(wanted):
        column = {item: c for c, item in enumerate(ids)}
        for q, items in enumerate(relevant):
            for item in items & column.keys():
                value = float(block[q, column[item]])
                if value != -np.inf:
                    scores[q].append(value)
                    where[q].append(int(position[column[item]]))
    return [np.asarray(s, dtype=np.float64) for s in scores], [np.asarray(w, dtype=np.int64) for w in where]


def _ahead_in_block(row: np.ndarray, position: np.ndarray, thresholds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """For each relevant score t_j (at gallery position p_j): the block's items scoring above t_j,
    plus those scoring exactly t_j at a position before p_j."""
    ordered = np.sort(row)
    right = np.searchsorted(ordered, thresholds, side="right")
    ahead = len(row) - right
    tied = right - np.searchsorted(ordered, thresholds, side="left")
    for j in np.flatnonzero(tied):  # exact ties are rare: counted one relevant item at a time
        ahead[j] += int(((row == thresholds[j]) & (position < indices[j])).sum())
    return ahead


def _merge_top(top_scores: np.ndarray, top_index: np.ndarray, scores: np.ndarray, position: np.ndarray,
               top_n: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``top_n`` of the kept top and a new block, stable: on a tie the earlier item first
    (kept entries precede the block's, and both are in gallery order)."""
    joined = np.hstack([top_scores, scores])
    where = np.hstack([top_index, np.broadcast_to(position, scores.shape)])
    order = np.argsort(-joined, axis=1, kind="stable")[:, :top_n]
    return np.take_along_axis(joined, order, axis=1), np.take_along_axis(where, order, axis=1)
