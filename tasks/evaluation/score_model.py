"""The score stage of ``rde evaluate``: one retriever's queries ranked against its gallery vectors (or
its scores file), each query's metrics, the summary per domain with bootstrap intervals, its run."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from rde.evaluation.model_scores import score_retriever
from rde.evaluation.plan import EvaluationPlan
from rde.evaluation.retrievers import RetrieverSpec
from rde.evaluation.scoring import metric_names, summary_by_domain
from storage.evaluation_schemas import MODEL_METRICS, QUERY_OUTCOMES, RUN_ROWS
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Stage, StageRun, Work, Write


class ScoreModel(Stage):
    """Each labelled query ranked against its domain's gallery (ties in gallery order), in blocks of
    one gallery shard: mAP@K, R@1/5/10, mINP, nDCG@10 and MRR per query, their means per domain
    with 95 % bootstrap intervals over queries, and the top ``evaluation.run_depth`` items per
    query (the run)."""

    version = "1"
    config = ("evaluation.map_cutoffs", "evaluation.run_depth", "evaluation.bootstrap_resamples", "track_facts")
    title = "Queries ranked and scored"
    row_unit = "queries"

    def __init__(self, spec: RetrieverSpec, plan: EvaluationPlan) -> None:
        self.spec, self.plan, self.folder = spec, plan, plan.model_folder(spec)
        self.name = f"score-{spec.slug}"
        self.reads = () if spec.kind == "scores" else (f"{plan.vectors_folder(spec)}/gallery_vectors",)
        self.writes = (Write(f"{self.folder}/evaluation", "model_metrics", MODEL_METRICS),
                       Write(f"{self.folder}/per_query", "query_outcomes", QUERY_OUTCOMES),
                       Write(f"{self.folder}/run", "run", RUN_ROWS))

    def lineage(self, run: StageRun) -> Lineage:
        bench = self.plan.benchmark
        return Lineage(models={"retriever": self.plan.lineage(self.spec)},
                       extra={"benchmark": bench.key}, upstream=list(bench.upstream))

    def run(self, run: StageRun) -> Work:
        section = run.section("evaluation")
        bench = self.plan.benchmark
        vectors = run.input(self.reads[0]) if self.reads else None
        scored, stats = score_retriever(self.spec, self.plan.profile, self.plan.lineage(self.spec), bench, vectors,
                                        section.run_depth, section.map_cutoffs)
        names = metric_names(section.map_cutoffs)
        summary, counts = summary_by_domain(scored, names, section.bootstrap_resamples)
        metrics = [{"benchmark": bench.name, "labels": bench.labels, "model": self.spec.text, "domain": domain,
                    "metric": m, "mean": v.mean, "low": v.low, "high": v.high, "queries": counts[domain]}
                   for domain, values in summary.items() for m, v in values.items()]
        outcomes = [{"query_id": s.query_id, "domain": s.domain, "text": s.text, "first_hit": s.ranking.first_hit,
                     "n_relevant": s.ranking.n_relevant, "top": list(s.ranking.top_ids[:5]),
                     "relevant": sorted(bench.qrels[s.query_id]),
                     "metrics": [{"name": k, "value": v} for k, v in s.metrics.items()]} for s in scored]
        runs = [{"query_id": s.query_id, "item_id": item, "rank": r, "score": score} for s in scored
                for r, (item, score) in enumerate(zip(s.ranking.top_ids, s.ranking.top_scores, strict=True), 1)]
        return Work.one({f"{self.folder}/evaluation": pa.Table.from_pylist(metrics, schema=MODEL_METRICS),
                         f"{self.folder}/per_query": pa.Table.from_pylist(outcomes, schema=QUERY_OUTCOMES),
                         f"{self.folder}/run": pa.Table.from_pylist(runs, schema=RUN_ROWS)},
                        {"input_rows": len(bench.queries), "accepted": len(scored), **stats})

    def report(self, run: StageRun, result: StageResult) -> Report:
        """The TREC run file (``run.trec`` beside the artifacts) and a log line: the headline metrics
        and, for a scores file, its rows naming unknown queries or items (counted, not evaluated)."""
        from rde.evaluation.scores_file import write_trec_run
        from storage.filesystem import join

        rows = run.output_artifact(f"{self.folder}/run")
        problem = ""
        if rows.is_complete():
            try:
                write_trec_run(join(run.output_url(self.folder), "run.trec"),
                               [(r["query_id"], r["item_id"], r["rank"], r["score"]) for r in rows.rows()],
                               self.spec.slug)
            except ValueError as exc:  # an id with white space has no TREC form; the run artifact has it
                problem = f"no run.trec: {exc}"
        overall = {r["metric"]: r["mean"] for r in run.output_artifact(f"{self.folder}/evaluation").rows()
                   if r["domain"] == "all"}
        shown: dict[str, Any] = {k: round(v, 4) for k, v in overall.items() if k in ("mAP@20", "R@1", "R@10")}
        unknown = [f"{result.stats[f'unknown_{what}_rows']} rows naming {result.stats[f'unknown_{what}']} unknown "
                   f"{what} (e.g. {', '.join(result.stats[f'unknown_{what}_examples'])}), not evaluated"
                   for what in ("queries", "items") if result.stats.get(f"unknown_{what}_rows")]
        labels = "" if self.plan.benchmark.labels == "verified" else f" [{self.plan.benchmark.labels.upper()} LABELS]"
        return Report(log="; ".join([f"{self.spec.text}{labels}: " + ", ".join(f"{k}={v}" for k, v in shown.items()),
                                     *unknown, *([problem] if problem else [])]))
