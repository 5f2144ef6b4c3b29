"""VEDJE flows' stages, one module each: vedje-features → vedje-train (``train-vedje``), index-cache
(``index-cache``) and rerank (``rerank``); and the flows' run summary."""

from __future__ import annotations

from typing import Any

from rde.vedje.data import clip_spans
from rde.vedje.model_store import source_artifact
from storage import Artifact
from tasks.framework import accounting
from tasks.framework.context import RunContext


def top_results(ctx: RunContext, reranked_url: str, top: int) -> list[dict[str, Any]]:
    """Per query of a ``rerank`` run, its best ``top`` items (ranks 1-based): item id, score, stage-1
    rank and score, and for clips the time span (seconds when the clip set records its frame rate)."""
    spans = clip_spans(ctx.profile.vedje.clips_path) if ctx.profile.vedje.source == "clips" else {}
    queries: dict[int, dict[str, Any]] = {}
    for r in sorted(Artifact(reranked_url).rows(), key=lambda r: (r["query_id"], r["rank"])):
        entry = queries.setdefault(r["query_id"], {"query": r["text"], "results": []})
        if len(entry["results"]) < top:
            entry["results"].append({"rank": r["rank"] + 1, "item_id": r["item_id"], "score": r["score"],
                                     "stage1_rank": r["stage1_rank"] + 1, "stage1_score": r["stage1_score"],
                                     "span": spans.get(r["item_id"])})
    return list(queries.values())


def _source_count(ctx: RunContext) -> int:
    """The profile's items counted from the source artifact itself (the input of the balance check)."""
    source = source_artifact(ctx.profile, ctx.output_root)
    if ctx.profile.vedje.source == "clips":
        return source.count_rows()
    return len({r["image_id"] for r in source.rows(["image_id"])})


def summary(ctx: RunContext, results: list[accounting.StageResult]) -> dict[str, Any]:
    """The run summary; for ``train-vedje`` the balance counts the source's items independently."""
    from tasks.training import training_summary

    counted = _source_count(ctx) if results[0].stage == "vedje-features" else None
    return training_summary(ctx, results, counted)
