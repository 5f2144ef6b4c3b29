"""The hand-labelled check set scored through ``rde evaluate``'s ranking and metrics: each expert's
mAP@K (each query against its own domain's crops) and the expected mAP@K of a random ranking."""

from __future__ import annotations

import numpy as np

from models.backends.interfaces import TextImageExpert
from models.domains import DomainSet
from rde.common.expert_check import CheckSet, expert_vectors
from rde.evaluation.scoring import means_by_domain, score_vectors


def check_queries(check: CheckSet) -> tuple[list[dict[str, str]], list[str], list[str], dict[str, set[str]]]:
    """A check set as ``rde.evaluation.scoring`` ranks it: its queries (each in its domain, where
    known), its gallery's ids and domains, and each query's relevant ids."""
    n_queries, n_gallery = len(check.queries), len(check.gallery_identities)
    query_ids = check.query_ids or [f"q{n}" for n in range(n_queries)]
    domains = check.query_domains or [""] * n_queries
    gallery_ids = check.gallery_ids or [str(j) for j in range(n_gallery)]
    gallery_domains = check.gallery_domains if check.query_domains else [""] * n_gallery
    queries = [{"query_id": q, "domain": d, "text": t} for q, d, t in zip(query_ids, domains, check.queries,
                                                                          strict=True)]
    qrels = {q: {gallery_ids[j] for j in check.relevant_positions(n)} for n, q in enumerate(query_ids)}
    return queries, gallery_ids, list(gallery_domains), qrels


def ranked_map(check: CheckSet, queries: np.ndarray, gallery: np.ndarray, k: int) -> float:
    """mAP@k of the rankings of ``queries`` against ``gallery`` (each query against its own domain's
    crops), through ``rde.evaluation.scoring``: the ranking and metrics of ``rde evaluate``."""
    found, ids, domains, qrels = check_queries(check)
    scored = score_vectors(queries, found, gallery, ids, domains, qrels, map_cutoffs=(k,))
    return means_by_domain(scored, (f"mAP@{k}",))["all"][f"mAP@{k}"] if scored else 0.0


def expert_map(expert: TextImageExpert, check: CheckSet, domains: DomainSet, k: int = 10,
               image_vecs: np.ndarray | None = None) -> float:
    """mAP@k of one expert on the check set (``domains``: the profile's, for the track facts)."""
    queries, gallery = expert_vectors(expert, check, domains, image_vecs)
    return ranked_map(check, queries, gallery, k)


def random_map(check: CheckSet, k: int = 10, trials: int = 200, seed: int = 0) -> float:
    """Expected mAP@k of a uniformly random ranking (Monte Carlo over ``trials`` random rankings,
    each from random vectors through the same ranking as the experts')."""
    rng = np.random.default_rng(seed)
    n_queries, n_gallery = len(check.queries), len(check.gallery_identities)
    return float(np.mean([ranked_map(check, rng.normal(size=(n_queries, 8)), rng.normal(size=(n_gallery, 8)), k)
                          for _ in range(trials)]))
