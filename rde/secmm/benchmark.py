"""The benchmark's files beside its tables: qrels from candidates and people's decisions, the
review files (site and Label Studio tasks) and the dataset card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rde.common.dataset_cards import loading_snippet
from rde.secmm.config import ReviewSpec
from rde.secmm.review_site import ReviewFiles, build_review
from storage import Artifact


def qrel_rows(candidates: list[dict[str, Any]], decisions: dict[tuple[str, str], dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """One qrels row per candidate: a person's decision on it (verified), else relevant and unverified."""
    rows = []
    for c in candidates:
        d = decisions.get((c["query_id"], c["image_id"]))
        rows.append({"query_id": c["query_id"], "image_id": c["image_id"],
                     "relevant": bool(d["relevant"]) if d else True, "verified": d is not None,
                     "annotator": d["annotator"] if d else None, "decided_at": d["decided_at"] if d else None,
                     "tool": d.get("tool") if d else None})
    return rows


def write_review_files(title: str, spec: ReviewSpec, candidates: Artifact, queries_url: str, gallery_url: str,
                       decisions: Artifact, folder: Path) -> dict[str, int]:
    """The review site and the Label Studio tasks (``review_site.build_review``), streamed over the
    candidates and the gallery in record batches; decisions already imported show as decided.
    Returns what it wrote (candidates, queries, Label Studio tasks)."""
    files = ReviewFiles(folder, title, candidates.manifest().stage_key,
                        spec.page_size, spec.thumbnail_height, spec.label_studio_images)
    queries = {q["query_id"]: q for q in Artifact(queries_url).rows(["query_id", "domain", "text"])}
    columns = ["query_id", "image_id", "experts", "best_rank"]
    imported = {(d["query_id"], d["image_id"]): d for d in decisions.rows()} if decisions.is_complete() else {}
    counts = build_review(files, (r for b in candidates.iter_batches(columns) for r in b.to_pylist()), queries,
                          (r for b in Artifact(gallery_url).iter_batches(["image_id", "image_bytes"], 256)
                           for r in b.to_pylist()), imported)
    return counts


BENCHMARK_TABLES = ("queries", "gallery", "qrels")  # the benchmark folder's tables, each a config of its card


def dataset_card(profile_name: str, bench: str) -> str:
    """The benchmark's dataset card: its tables, per-domain counts and qrels, read back from ``bench``."""
    queries = Artifact(f"{bench}/queries").to_pandas(["query_id", "domain"])
    gallery = Artifact(f"{bench}/gallery").to_pandas(["image_id", "domain"])
    qrels = Artifact(f"{bench}/qrels").to_pandas()
    per_query = qrels.groupby("query_id").size()
    low, mid, high = (int(per_query.min()), float(per_query.median()), int(per_query.max())) if len(per_query) \
        else (0, 0.0, 0)
    lines = [f"# SecMM-style benchmark ({profile_name} profile)", "",
             "Text-to-image multi-match retrieval: `queries`, `gallery`, `qrels` (Parquet), three tables with "
             "different columns, each a config of this card.", "",
             *loading_snippet(BENCHMARK_TABLES), "",
             "| domain | queries | gallery images |", "|---|---|---|"]
    for domain in sorted(set(gallery.domain) | set(queries.domain)):
        lines.append(f"| {domain} | {(queries.domain == domain).sum()} | {(gallery.domain == domain).sum()} |")
    verified = int(qrels.verified.sum()) if len(qrels) else 0
    lines += ["", f"qrels: {len(qrels)} rows, {verified} verified by a person. Matches per query: "
              f"min {low}, median {mid:.0f}, max {high}.",
              "", "Unverified rows are MECF candidates (the union of the experts' top-K) awaiting review: "
              "metrics against them measure agreement with the experts, not correctness.", "",
              "Lineage: see `_manifest.json` in each folder (stage keys, models, prompt versions, upstream)."]
    return "\n".join(lines)
