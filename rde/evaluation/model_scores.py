"""One retriever's scored queries on a benchmark: a model's query vectors against its stored gallery
vectors, read one gallery shard at a time, or a scores file's rows for a model we cannot run."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from rde.evaluation.benchmarks import Benchmark
from rde.evaluation.plan import loaded_retriever
from rde.evaluation.retrievers import RetrieverError, RetrieverSpec
from rde.evaluation.scoring import ScoredQuery, score_queries, vector_score_blocks
from rde.evaluation.streamed_ranking import ScoreBlocks
from storage import Artifact


def score_retriever(spec: RetrieverSpec, profile: Any, lineage: dict[str, Any], bench: Benchmark,
                    vectors: Artifact | None, run_depth: int,
                    map_cutoffs: Sequence[int]) -> tuple[list[ScoredQuery], dict[str, Any]]:
    """The scored queries and the stage's extra counts (a scores file's unknown rows); ``lineage``
    is the spec's (the loaded-model cache's key)."""
    if spec.kind == "scores":
        return _from_scores_file(spec, bench, run_depth, map_cutoffs)
    assert vectors is not None
    expert = loaded_retriever(spec, profile, lineage)
    texts = [q["text"] for q in bench.queries]
    query_vecs = checked_text_vectors(spec, expert.encode_text(texts), len(texts))
    track_slots = getattr(expert, "track_slots", None)
    stored = StoredVectors(vectors, bench, spec, query_vecs.shape[1], track_slots is not None)

    def domain_blocks(domain: str, positions: list[int]) -> ScoreBlocks:
        return vector_score_blocks(query_vecs[positions], [texts[n] for n in positions],
                                   lambda only: stored.blocks(domain, only), track_slots)

    return score_queries(bench.queries, bench.qrels, domain_blocks, run_depth, map_cutoffs), {}


def checked_text_vectors(spec: RetrieverSpec, vectors: Any, count: int) -> np.ndarray:
    """A model's query vectors, or one line saying what is wrong with them."""
    found = np.asarray(vectors, dtype=np.float32)
    if found.ndim != 2 or found.shape[0] != count:
        raise RetrieverError(f"{spec.text}: encode_text returned shape {found.shape} for {count} texts")
    if not np.isfinite(found).all():
        raise RetrieverError(f"{spec.text}: encode_text returned NaN or infinite values")
    return found


class StoredVectors:
    """A retriever's gallery vectors (the embed-gallery artifact), one domain's rows per shard, each
    with its position in that domain's gallery, and their track facts when the retriever fuses
    them (``with_facts``: read only then)."""

    def __init__(self, vectors: Artifact, bench: Benchmark, spec: RetrieverSpec, text_width: int,
                 with_facts: bool = False) -> None:
        self.vectors, self.bench, self.spec, self.text_width = vectors, bench, spec, text_width
        self.with_facts = with_facts
        self.shards = len(vectors.manifest().shards)
        self.offsets: list[dict[str, int]] = []  # per shard: domain -> rows of that domain before it
        seen: dict[str, int] = {}
        for index in range(self.shards):
            self.offsets.append(dict(seen))
            for d in vectors.read_shard(index, ["domain"]).column("domain").to_pylist():
                seen[d] = seen.get(d, 0) + 1

    def blocks(self, domain: str, only: set[str] | None) -> Iterator[tuple[list[str], np.ndarray, np.ndarray,
                                                                             list[dict] | None]]:
        for index in range(self.shards):
            table = self.vectors.read_shard(index, ["item_id", "domain", "vector"])
            ids, domains = table.column("item_id").to_pylist(), table.column("domain").to_pylist()
            in_domain = [n for n, d in enumerate(domains) if d == domain]
            keep = [(k, n) for k, n in enumerate(in_domain) if only is None or ids[n] in only]
            if not keep:
                continue
            rows = np.array([n for _, n in keep], dtype=np.int64)
            flat = table.column("vector").take(rows).combine_chunks().flatten().to_numpy()
            vecs = flat.reshape(len(rows), -1).astype(np.float32)
            if vecs.shape[1] != self.text_width:
                raise RetrieverError(f"{self.spec.text}: text vectors have width {self.text_width}, image vectors "
                                     f"{vecs.shape[1]}: the two sides must share one space")
            picked = [ids[n] for n in rows]
            where = np.array([self.offsets[index].get(domain, 0) + k for k, _ in keep], dtype=np.int64)
            yield picked, where, vecs, self.bench.gallery.facts(picked) if self.with_facts else None


def _from_scores_file(spec: RetrieverSpec, bench: Benchmark, run_depth: int,
                      map_cutoffs: Sequence[int]) -> tuple[list[ScoredQuery], dict[str, Any]]:
    """A scores file's rows as each query's scores over its domain's gallery, one gallery shard at a
    time (``-inf``: not ranked). Rows naming unknown queries or items are counted, and the rest
    evaluated."""
    from rde.evaluation.scores_file import read_scores

    found = read_scores(spec.target, [q["query_id"] for q in bench.queries], bench.gallery.ids())
    by_query: dict[str, dict[str, float]] = {}
    for q, item, score in found.triples():
        by_query.setdefault(q, {})[item] = score

    def domain_blocks(domain: str, positions: list[int]) -> ScoreBlocks:
        rows = [by_query.get(bench.queries[n]["query_id"], {}) for n in positions]

        def blocks(only: set[str] | None) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
            before = 0  # items of this domain in earlier shards
            for index in range(bench.gallery.shards):
                ids, domains = bench.gallery.ids_domains(index)
                mine = [i for i, d in zip(ids, domains, strict=True) if d == domain]
                keep = [k for k, i in enumerate(mine) if only is None or i in only]
                if keep:
                    matrix = np.full((len(rows), len(keep)), -np.inf)
                    for r, scores in enumerate(rows):
                        for c, k in enumerate(keep):
                            matrix[r, c] = scores.get(mine[k], -np.inf)
                    yield [mine[k] for k in keep], np.asarray(keep, dtype=np.int64) + before, matrix
                before += len(mine)

        return blocks

    scored = score_queries(bench.queries, bench.qrels, domain_blocks, run_depth, map_cutoffs)
    return scored, found.stats()
