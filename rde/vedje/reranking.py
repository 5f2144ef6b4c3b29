"""Online reranking (VEDJE Alg. 1, lines 6–13) of a list of queries: stage-1 search over the index,
the candidates' caches fetched, joint scoring; a ranked row per (query, candidate)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from models.backends.interfaces import TextImageExpert
from models.reranker.cache_store import CacheIndex
from models.reranker.vedje import Vedje
from rde.vedje.config import VedjeSpec
from rde.vedje.training import joint_scores


def rerank_queries(model: Vedje, cache: CacheIndex, stage1: TextImageExpert, texts: Sequence[str],
                   index_rows: list[dict[str, Any]], query_items: Sequence[str] | None, spec: VedjeSpec,
                   done: Callable[[int], Any]) -> tuple[list[dict[str, Any]], list[float]]:
    """The reranked rows of each query in ``texts`` over the stage-1 ``index_rows`` (``item_id``,
    ``embedding``, ``group``), and each query's latency in seconds. ``query_items``: each query's
    own item (its relevant ones share its group), or None for unlabelled queries. ``done(n)`` is
    called after each query."""
    n_max = max(spec.candidates)
    ids = [r["item_id"] for r in index_rows]
    emb = torch.tensor([r["embedding"] for r in index_rows])
    group = {r["item_id"]: r["group"] for r in index_rows}
    out, latencies = [], []
    for qi, text in enumerate(texts):
        start = time.perf_counter()
        q = torch.from_numpy(stage1.encode_text([text]))
        sims = (q @ emb.T)[0]
        top = torch.argsort(sims, descending=True, stable=True)[:n_max]
        cand = [ids[int(i)] for i in top]
        caches = cache.fetch(cand)
        s = joint_scores(model, [text], [(0, k) for k in range(len(cand))], caches, sims[top],
                         spec.score_batch, spec.score_path)
        latencies.append(time.perf_counter() - start)
        order = np.argsort(-s, kind="stable")
        truth = group[query_items[qi]] if query_items is not None else None
        out += [{"query_id": qi, "text": text, "rank": r, "item_id": cand[j], "stage1_rank": int(j),
                 "stage1_score": float(sims[top[j]]), "score": float(s[j]),
                 "relevant": None if truth is None else group[cand[j]] == truth} for r, j in enumerate(order)]
        done(qi + 1)
    return out, latencies
