"""The rerank stage: stage-1 search → cache fetch → joint scoring, with recall against stage 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from models.reranker.cache_store import CacheIndex
from rde.vedje.model_store import load_model, stage1_spec
from rde.vedje.reranking import rerank_queries
from rde.vedje.training import recall_at
from storage import Artifact
from storage.schemas import RECALL
from tasks.framework.accounting import StageResult
from tasks.framework.context import RunContext
from tasks.framework.reporting import Progress, rounded_rows
from tasks.framework.stage import Lineage, Report, Stage, StageRun, Work, Write

RERANKED = pa.schema([pa.field("query_id", pa.int32(), nullable=False), pa.field("text", pa.string(), nullable=False),
                      pa.field("rank", pa.int32(), nullable=False), pa.field("item_id", pa.string(), nullable=False),
                      pa.field("stage1_rank", pa.int32(), nullable=False),
                      pa.field("stage1_score", pa.float64(), nullable=False),
                      pa.field("score", pa.float64(), nullable=False), pa.field("relevant", pa.bool_())])


@dataclass(frozen=True)
class RerankInputs:
    """What ``lineage`` loaded: the trained model, the item cache and the stage-1 index artifact."""

    model: Any
    cache: Any
    index: Artifact


class Rerank(Stage):
    """Online reranking (Alg. 1, lines 6–13) for the given queries, or for the test split's captions
    (then with R@K of stage 1 vs rerank at each N_c); the caches must match the model's lineage."""

    name = "rerank"
    version = "1"
    prepares = RerankInputs
    writes = (Write("reranked", "reranked", RERANKED),
              Write("rerank_evaluation", "evaluation", RECALL))
    # the whole section: the trained model is rebuilt from its architecture fields (load_model)
    config = ("vedje",)
    balance = True

    def __init__(self, queries: list[str] | None = None) -> None:
        self.queries = queries

    def lineage(self, run: StageRun) -> Lineage:
        ctx = run.ctx
        model, meta = load_model(ctx.profile, ctx.output_root)
        idx_ctx = RunContext(ctx.profile, "index-cache", ctx.output_root)
        cache = CacheIndex(idx_ctx.artifact_url("cache"), meta["cache_lineage"])
        index_art = Artifact(idx_ctx.artifact_url("stage1_index"))
        indexed_with = index_art.manifest().models.get("stage1")
        if indexed_with != run.registry().lineage(stage1_spec(ctx.profile)):
            raise ValueError(f"the stage-1 index at {index_art.url} was built with another stage-1 expert "
                             f"({(indexed_with or {}).get('model_id')!r}, profile now "
                             f"{stage1_spec(ctx.profile).model_id!r}): run `rde index-cache` again")
        run.prepared = RerankInputs(model, cache, index_art)
        return Lineage(extra={"cache": cache.fingerprint, "model": meta, "queries": self.queries},
                       upstream=[index_art])

    def run(self, run: StageRun) -> Work:
        ctx, spec = run.ctx, run.section("vedje")
        inputs: RerankInputs = run.prepared
        model, cache, index_art = inputs.model, inputs.cache, inputs.index
        index_rows = index_art.rows()
        labelled = self.queries is None
        query_items = None
        if labelled:
            train_ctx = RunContext(ctx.profile, "train-vedje", ctx.output_root)
            q_rows = [r for r in Artifact(train_ctx.artifact_url("vedje_queries")).rows(["item_id", "split", "text"])
                      if r["split"] == "test"]
            index_rows = [r for r in index_rows if r["split"] == "test"]
            texts = [r["text"] for r in q_rows]
            query_items = [r["item_id"] for r in q_rows]
        else:
            texts = list(self.queries or [])
        stage1 = run.registry().expert(stage1_spec(ctx.profile))
        with Progress(f"{ctx.flow_name}-progress", "rerank: queries done", stage="rerank", total=len(texts),
                      unit="queries") as progress:
            out, latencies = rerank_queries(model, cache, stage1, texts, index_rows, query_items, spec,
                                            progress.update)
        evaluation = []
        if labelled and texts:
            evaluation = _recall_rows(out, len(texts), len(index_rows), spec.candidates)
        # input: the queries asked; accepted: the queries that got a ranked list
        stats = {"input_rows": len(texts), "accepted": len({r["query_id"] for r in out}), "rejected": {},
                 "median_query_ms": round(1000 * float(np.median(latencies)), 2) if latencies else None,
                 "cache_bytes_per_query": cache.stats.bytes // max(len(texts), 1)}
        return Work.one({"reranked": pa.Table.from_pylist(out, schema=RERANKED),
                         "rerank_evaluation": pa.Table.from_pylist(evaluation, schema=RECALL)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        evaluation = run.output_artifact("rerank_evaluation").rows()
        stats = result.stats
        tables = [("evaluation", rounded_rows(evaluation, 2),
                   "Stage-1 vs VEDJE rerank (R@K, test split) from the stored caches")] if evaluation else []
        return Report(tables=tables, log=f"rerank: {result.accepted} queries, median {stats.get('median_query_ms')} "
                                         f"ms/query, {stats.get('cache_bytes_per_query')} cache bytes read per query")


def _recall_rows(out: list[dict], n_queries: int, gallery: int, n_candidates: list[int]) -> list[dict[str, Any]]:
    """R@1/5/10 over the top-N_c lists (stage 1 order vs reranked) from the written rows."""
    by_q: dict[int, list[dict]] = {}
    for r in out:
        by_q.setdefault(r["query_id"], []).append(r)
    rows = []
    for n in sorted(set(n_candidates)):
        for name, key in (("stage-1", "stage1_rank"), ("rerank", None)):
            ranked = [[r["relevant"] for r in sorted((r for r in rs if r["stage1_rank"] < n),
                                                     key=lambda r: r["stage1_rank"] if key else -r["score"])]
                      for rs in by_q.values()]
            rows += [{"ranking": name, "n_candidates": min(n, gallery), "metric": f"R@{k}",
                      "value": recall_at(ranked, [True] * len(ranked), k), "queries": n_queries, "gallery": gallery,
                      "precision": None} for k in (1, 5, 10)]
    return rows
