"""The streamed ranking of ``rde evaluate``: a gallery that arrives one shard at a time ranks exactly as
the whole score matrix does (ties, unranked items and relevant items in any shard)."""

from __future__ import annotations

import numpy as np
import pytest
from whole_matrix_ranking import rank_scores

from rde.evaluation.streamed_ranking import rank_blocks


@pytest.mark.parametrize("block", [1, 7, 64, 500])
def test_blocks_of_any_size_rank_as_the_whole_matrix(block: int) -> None:
    rng = np.random.default_rng(3)
    scores = np.round(rng.normal(size=(20, 300)), 1)  # many ties
    scores[rng.random(scores.shape) < 0.05] = -np.inf
    relevant = [rng.choice(300, size=rng.integers(1, 40), replace=False) for _ in range(20)]
    whole = rank_scores(scores, relevant, top_n=25)
    ids = [f"item{j}" for j in range(300)]

    def blocks(only):
        for start in range(0, 300, block):
            cols = np.array([j for j in range(start, min(300, start + block)) if only is None or ids[j] in only], int)
            if len(cols):
                yield [ids[j] for j in cols], cols, scores[:, cols]

    streamed = rank_blocks(blocks, [{ids[j] for j in rel} for rel in relevant], top_n=25)
    for q in range(20):
        assert list(streamed[q].positions) == whole.positions[q].tolist()
        assert [int(i[4:]) for i in streamed[q].top_ids] == whole.top_idx[q].tolist()
        assert list(streamed[q].top_scores) == whole.top_scores[q].tolist()
        assert streamed[q].n_relevant == len(relevant[q])
