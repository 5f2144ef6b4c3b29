"""The mecf stage: multi-expert candidate filtering, the union of every expert's top-K (Eq. 1)."""

from __future__ import annotations

import pyarrow as pa

from rde.common.embedding_cache import expert_caches
from rde.common.track_context import track_facts
from rde.secmm import mecf
from storage.schemas import (
    CANDIDATES,
)
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


class Mecf(Stage):
    """Every expert retrieves its top-K per query within the query's domain; keep the union (Eq. 1)."""

    name = "mecf"
    # 5: exact scores the same on any CPU (rde.common.topk.inner_products); 6: the attribute expert's
    # motion and direction slots compared with the gallery's video tracks
    version = "6"
    reads = ("queries", "gallery", "accepted")
    writes = (Write("candidates", "candidates", CANDIDATES),)
    config = ("retrieval", "track_facts", "domains")
    resources = Resources(device="gpu", hold_slot=False)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"experts": [run.registry().lineage(s) for s in run.models.experts]})

    def run(self, run: StageRun) -> Work:
        retrieval = run.section("retrieval")
        registry = run.registry()
        queries = run.input("queries").rows(["query_id", "domain", "text"])
        gallery_artifact = run.input("gallery")
        gallery = gallery_artifact.rows(["image_id", "domain"])  # no bytes: the caches stream them per shard
        caches = expert_caches(run.ctx.base, registry, run.models.experts)
        rows, per_expert_counts = mecf.candidate_rows(
            queries, gallery, gallery_artifact, registry, run.models.experts, caches, retrieval,
            lambda: track_facts(run.input("accepted"), [g["image_id"] for g in gallery], run.section("track_facts"),
                                run.domains))
        stats = {"input_rows": len(queries), "accepted": len(rows), "per_expert_candidates": per_expert_counts,
                 "union_candidates": len(rows), "embedded": sum(c.embedded for c in caches)}
        return Work.one({"candidates": pa.Table.from_pylist(rows, schema=CANDIDATES)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        table = [{"expert": k, "candidates": v} for k, v in stats.get("per_expert_candidates", {}).items()]
        table.append({"expert": "union (Eq. 1)", "candidates": stats.get("union_candidates", 0)})
        return Report(tables=[("mecf-union", table, "MECF: top-K candidates per expert and their union")],
                      log=f"mecf: {table}")
