"""Scoring a text–image expert on a multi-match benchmark (queries, gallery, qrels).

mAP@K uses ``rde.common.metrics.average_precision_at_k`` (denominator min(K, #relevant)). R@K is the
share of queries with at least one relevant image in the top K (the usual text-to-image
retrieval recall). Each query ranks only the gallery of its own domain, as in SecMM-TBIR.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rde.common.topk import topk_exact

MAP_CUTOFFS = (10, 20, 30)
RECALL_CUTOFFS = (1, 5, 10)


def evaluate_rankings(ranked_ids: Sequence[Sequence[str]], relevant: Sequence[set[str]]) -> dict[str, float]:
    """mAP@10/20/30 and R@1/5/10 over queries that have at least one relevant image."""
    from rde.common.metrics import average_precision_at_k

    out: dict[str, float] = {}
    valid = [(r, rel) for r, rel in zip(ranked_ids, relevant, strict=True) if rel]
    for k in MAP_CUTOFFS:
        aps = [average_precision_at_k([x in rel for x in r], len(rel), k) for r, rel in valid]
        out[f"mAP@{k}"] = float(np.mean(aps)) if aps else 0.0
    for k in RECALL_CUTOFFS:
        hits = [any(x in rel for x in r[:k]) for r, rel in valid]
        out[f"R@{k}"] = float(np.mean(hits)) if hits else 0.0
    out["queries"] = float(len(valid))
    return out


def rank_gallery(query_vecs: np.ndarray, gallery_vecs: np.ndarray, gallery_ids: Sequence[str],
                 k: int) -> list[list[str]]:
    idx, _ = topk_exact(query_vecs, gallery_vecs, k)
    return [[gallery_ids[j] for j in row] for row in idx]


def evaluate_expert(query_vecs: np.ndarray, query_domains: Sequence[str], query_ids: Sequence[str],
                    gallery_vecs: np.ndarray, gallery_domains: Sequence[str], gallery_ids: Sequence[str],
                    qrels: Mapping[str, set[str]]) -> dict[str, dict[str, float]]:
    """Metrics per domain and over all queries; each query ranks its own domain's gallery."""
    k = max(*MAP_CUTOFFS, *RECALL_CUTOFFS)
    gal_dom = np.array(gallery_domains)
    ranked: dict[str, list[str]] = {}
    for domain in sorted(set(query_domains)):
        q_idx = [i for i, d in enumerate(query_domains) if d == domain]
        g_idx = np.flatnonzero(gal_dom == domain)
        if not q_idx or not len(g_idx):
            continue
        rows = rank_gallery(query_vecs[q_idx], gallery_vecs[g_idx], [gallery_ids[j] for j in g_idx], k)
        ranked.update({query_ids[i]: row for i, row in zip(q_idx, rows, strict=True)})
    results: dict[str, dict[str, float]] = {}
    for domain in [*sorted(set(query_domains)), "all"]:
        ids = [q for q, d in zip(query_ids, query_domains, strict=True) if domain in ("all", d) and q in ranked]
        results[domain] = evaluate_rankings([ranked[q] for q in ids], [qrels.get(q, set()) for q in ids])
    return results
