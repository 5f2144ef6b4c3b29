"""Multi-Expert Collaborative Filtering (DSMM-TBIR Eq. 1).

C(q) = ⋃_{i=1..M} { x ∈ I : rank_I(sim(φ_i(q), ψ_i(x))) ≤ K }: each expert retrieves its own
top-K by cosine similarity, and the candidate set is the union, kept with per-expert provenance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from models.specs import ModelSpec, Strict
from rde.common.declarations import profile_section
from rde.common.embedding_cache import EmbeddingCache
from rde.common.topk import AnnSpec, topk
from rde.common.track_slots import fuse_track_slots
from storage import Artifact


@profile_section("retrieval", "Multi-expert candidate retrieval (MECF).")
class RetrievalSpec(Strict):
    """Multi-Expert Collaborative Filtering (paper Eq. 1): top-K per expert, union of candidates."""

    top_k: int = Field(1000, ge=1, description="Candidates each expert contributes per query (the union of "
                       "all experts' top-K is the candidate set).")
    index_above: int = Field(200_000, ge=1, description="Gallery size above which an approximate (ANN) index "
                             "is searched instead of an exact search.")
    ann: AnnSpec = Field(default_factory=AnnSpec, description="The approximate index and its recall check.")


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


def candidate_rows(queries: list[dict[str, Any]], gallery: list[dict[str, Any]], gallery_artifact: Artifact,
                   registry: Any, experts: Sequence[ModelSpec], caches: Sequence[EmbeddingCache],
                   retrieval: RetrievalSpec, read_tracks: Callable[[], dict[str, dict[str, list[str]]]]
                   ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The candidate rows of every query (``query_id``, ``domain``, ``text``) within its domain of the
    gallery (``image_id``, ``domain``; its vectors streamed from ``gallery_artifact`` through each
    expert's cache): each expert's top-K (``registry``: the profile's ``ModelRegistry``), then their
    union. ``read_tracks`` reads the gallery's track facts, once, for an expert with track slots.
    Returns the rows and each expert's candidate count."""
    tracks: dict[str, dict[str, list[str]]] | None = None  # read once, for an expert with track slots
    rows = []
    per_expert_counts: dict[str, int] = {}
    for domain in sorted({q["domain"] for q in queries}):
        q_idx = [i for i, q in enumerate(queries) if q["domain"] == domain]
        g_idx = [i for i, g in enumerate(gallery) if g["domain"] == domain]
        if not q_idx or not g_idx:
            continue
        per_expert = {}
        for spec, cache in zip(experts, caches, strict=True):
            expert = registry.expert(spec)
            name = f"{spec.backend}:{spec.model_id}"
            texts = [queries[i]["text"] for i in q_idx]
            qv = expert.encode_text(texts)
            kept, gv = cache.embed_artifact(gallery_artifact, ["image_id", "domain"],
                                            keep=lambda r, domain=domain: r["domain"] == domain)
            if getattr(expert, "track_slots", False):
                if tracks is None:
                    tracks = read_tracks()
                qv, gv = fuse_track_slots(qv, gv, texts, [tracks.get(r["image_id"], {}) for r in kept],
                                          expert.track_slots)
            per_expert[name] = topk(qv, gv, retrieval.top_k, retrieval.index_above, retrieval.ann)
            per_expert_counts[name] = per_expert_counts.get(name, 0) + int(per_expert[name][0].size)
        for cand in union_candidates(per_expert):
            names = sorted(cand.ranks)
            rows.append({"query_id": queries[q_idx[cand.query]]["query_id"],
                         "image_id": gallery[g_idx[cand.item]]["image_id"], "domain": domain,
                         "experts": names, "ranks": [cand.ranks[n] for n in names],
                         "scores": [cand.scores[n] for n in names], "best_rank": min(cand.ranks.values())})
    return rows, per_expert_counts
