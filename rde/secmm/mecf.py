"""Multi-Expert Collaborative Filtering (DSMM-TBIR Eq. 1).

C(q) = ⋃_{i=1..M} { x ∈ I : rank_I(sim(φ_i(q), ψ_i(x))) ≤ K }: each expert retrieves its own
top-K by cosine similarity, and the candidate set is the union, kept with per-expert provenance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Candidate:
    query: int
    item: int
    ranks: dict[str, int]  # expert name → 1-based rank (experts that retrieved it)
    scores: dict[str, float]

    @property
    def n_experts(self) -> int:
        return len(self.ranks)


def union_candidates(per_expert: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[Candidate]:
    """Eq. 1: the union over experts of each query's top-K, with every expert's rank and score.

    Sorted by query, then by best (lowest) rank across experts, then item index.
    """
    merged: dict[tuple[int, int], tuple[dict[str, int], dict[str, float]]] = {}
    for expert, (indices, scores) in per_expert.items():
        for q, (row_idx, row_val) in enumerate(zip(indices, scores, strict=True)):
            for rank, (item, score) in enumerate(zip(row_idx, row_val, strict=True), start=1):
                ranks, vals = merged.setdefault((q, int(item)), ({}, {}))
                ranks[expert] = rank
                vals[expert] = float(score)
    out = [Candidate(q, item, ranks, vals) for (q, item), (ranks, vals) in merged.items()]
    out.sort(key=lambda c: (c.query, min(c.ranks.values()), c.item))
    return out
