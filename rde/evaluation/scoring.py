"""One retriever's per-query outcomes on a benchmark: each query ranked against its own domain's
gallery (``streamed_ranking.rank_blocks``), its metrics (``metrics.query_metrics``), and the
summary per domain with bootstrap intervals. The single ranking and metric path of the engine:
``rde evaluate``, build-secmm's evaluate stage and ``rde check-experts`` all score through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rde.common.metrics import average_precision_at_k
from rde.common.topk import inner_products
from rde.common.track_slots import fuse_track_slots
from rde.evaluation.metrics import query_metrics, summarize
from rde.evaluation.results import METRICS, Interval
from rde.evaluation.streamed_ranking import QueryRanking, ScoreBlocks, rank_blocks

# one domain's gallery vectors in blocks: (ids, positions in the domain's gallery, vectors, track facts or None)
VectorBlocks = Callable[[set[str] | None], Iterator[tuple[list[str], np.ndarray, np.ndarray, list[dict] | None]]]


@dataclass(frozen=True)
class ScoredQuery:
    """A query with its ranking and its metrics."""

    query_id: str
    domain: str
    text: str
    ranking: QueryRanking
    metrics: dict[str, float]


def metric_names(map_cutoffs: Sequence[int] = (10, 20, 30)) -> tuple[str, ...]:
    """The metrics reported: mAP at each cut-off (the paper's 10/20/30 by default), then the rest."""
    return (*(f"mAP@{k}" for k in map_cutoffs), *(m for m in METRICS if not m.startswith("mAP@")))


def outcome_metrics(ranking: QueryRanking, map_cutoffs: Sequence[int] = (10, 20, 30)) -> dict[str, float]:
    """``query_metrics`` of a ranking, with mAP at the chosen cut-offs (the same AP@K definition)."""
    found = query_metrics(ranking.positions, ranking.n_relevant)
    hits = set(ranking.positions)
    for k in map_cutoffs:
        if f"mAP@{k}" not in found:
            found[f"mAP@{k}"] = float(average_precision_at_k([p in hits for p in range(1, k + 1)],
                                                             ranking.n_relevant, k))
    return {m: found[m] for m in metric_names(map_cutoffs)}


def vector_score_blocks(query_vecs: np.ndarray, texts: list[str], blocks: VectorBlocks,
                        track_slots: Any = None) -> ScoreBlocks:
    """Score blocks from gallery vector blocks: exact inner products (the same bits in any block
    shape); an expert with track slots fuses each block with its items' track facts first."""

    def scored(only: set[str] | None) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
        for ids, where, vecs, facts in blocks(only):
            queries, gallery = query_vecs, vecs
            if track_slots is not None:
                queries, gallery = fuse_track_slots(query_vecs, vecs, texts, facts or [{} for _ in ids], track_slots)
            yield ids, where, inner_products(queries, gallery)

    return scored


def memory_blocks(ids: Sequence[str], vecs: np.ndarray, facts: list[dict] | None = None) -> VectorBlocks:
    """One in-memory gallery as a single block (``only`` filters its rows)."""

    def blocks(only: set[str] | None) -> Iterator[tuple[list[str], np.ndarray, np.ndarray, list[dict] | None]]:
        keep = np.arange(len(ids)) if only is None else np.array([i for i, x in enumerate(ids) if x in only], int)
        yield ([ids[i] for i in keep], keep, vecs[keep] if len(keep) else vecs[:0],
               None if facts is None else [facts[i] for i in keep])

    return blocks


def score_queries(queries: Sequence[Mapping[str, str]], qrels: Mapping[str, set[str]],
                  domain_blocks: Callable[[str, list[int]], ScoreBlocks], top_n: int = 100,
                  map_cutoffs: Sequence[int] = (10, 20, 30)) -> list[ScoredQuery]:
    """Every query with at least one relevant item, ranked against its domain's gallery
    (``domain_blocks(domain, query positions)``: that domain's score blocks for those queries), in
    the queries' order."""
    out: dict[int, ScoredQuery] = {}
    for domain in sorted({q["domain"] for q in queries}):
        positions = [n for n, q in enumerate(queries) if q["domain"] == domain and qrels.get(q["query_id"])]
        if not positions:
            continue
        rankings = rank_blocks(domain_blocks(domain, positions), [set(qrels[queries[n]["query_id"]])
                                                                  for n in positions], top_n)
        for n, ranking in zip(positions, rankings, strict=True):
            q = queries[n]
            out[n] = ScoredQuery(q["query_id"], domain, q["text"], ranking, outcome_metrics(ranking, map_cutoffs))
    return [out[n] for n in sorted(out)]


def summary_by_domain(scored: Sequence[ScoredQuery], names: Sequence[str], resamples: int = 10_000,
                      seed: int = 0) -> tuple[dict[str, dict[str, Interval]], dict[str, int]]:
    """Per domain and over all queries (``all``): each metric's mean with its 95 % bootstrap
    interval, and the number of queries scored."""
    groups = rows_by_domain(scored)
    return ({domain: summarize(rows, tuple(names), resamples=resamples, seed=seed) for domain, rows in groups.items()},
            {domain: len(rows) for domain, rows in groups.items()})


def rows_by_domain(scored: Sequence[ScoredQuery]) -> dict[str, list[dict[str, float]]]:
    """The scored queries' metric rows per domain, then over all of them (``all``); empty domains left out."""
    groups = {domain: [s.metrics for s in scored if domain in ("all", s.domain)]
              for domain in [*sorted({s.domain for s in scored}), "all"]}
    return {domain: rows for domain, rows in groups.items() if rows}


def score_vectors(query_vecs: np.ndarray, queries: Sequence[Mapping[str, str]], gallery_vecs: np.ndarray,
                  gallery_ids: Sequence[str], gallery_domains: Sequence[str], qrels: Mapping[str, set[str]],
                  track_slots: Any = None, facts: list[dict] | None = None, top_n: int = 100,
                  map_cutoffs: Sequence[int] = (10, 20, 30)) -> list[ScoredQuery]:
    """``score_queries`` over an in-memory gallery (the build's evaluate stage, check sets): each
    domain's rows as one block; with ``track_slots`` (an expert's slot layout), fused with ``facts``
    (one dict per item)."""
    texts = [q["text"] for q in queries]
    domains = np.asarray(gallery_domains)

    def domain_blocks(domain: str, positions: list[int]) -> ScoreBlocks:
        rows = np.flatnonzero(domains == domain)
        blocks = memory_blocks([gallery_ids[j] for j in rows], gallery_vecs[rows],
                               None if facts is None else [facts[j] for j in rows])
        return vector_score_blocks(query_vecs[positions], [texts[n] for n in positions], blocks, track_slots)

    return score_queries(queries, qrels, domain_blocks, top_n, map_cutoffs)


def means_by_domain(scored: Sequence[ScoredQuery], names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per domain and ``all``: each metric's mean over the scored queries, and ``queries`` (their number)."""
    return {domain: {m: float(np.mean([r[m] for r in rows])) for m in names} | {"queries": float(len(rows))}
            for domain, rows in rows_by_domain(scored).items()}
