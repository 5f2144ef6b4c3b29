"""The evaluate stage: zero-shot retrieval per expert and domain on verified labels and check sets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from rde.common.embedding_cache import EmbeddingCache, expert_caches
from rde.common.expert_check import gallery_track_facts, load_check_set, load_check_yaml, restrict_to
from rde.common.track_context import track_facts
from rde.evaluation.check_sets import check_queries
from rde.evaluation.scoring import means_by_domain, metric_names, score_vectors
from storage.hashing import sha256_json
from storage.locations import resolve_location
from storage.schemas import (
    EVALUATION,
)
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class CheckFiles:
    """The profile's check sets, resolved by ``lineage`` (their contents are in the key)."""

    paths: list[str]


class Evaluate(Stage):
    """mAP@10/20/30, R@1/5/10, mINP, nDCG@10 and MRR per domain for every configured expert (through
    ``rde.evaluation.scoring``, the ranking and metrics of ``rde evaluate``), on the built benchmark's
    verified qrels (none until people review the candidates: reported as pending) and on the
    profile's hand-labelled check sets."""

    name = "evaluate"
    # 4: rankings from scores that are the same on any CPU; 5: the attribute expert's track slots;
    # 6: through rde evaluate's scoring: mINP, nDCG@10 and MRR too; 7: a check set's queries and crops
    # of the profile's domains only
    version = "7"
    reads = ("benchmark/qrels", "benchmark/queries", "benchmark/gallery", "accepted")
    writes = (Write("evaluation", "evaluation", EVALUATION),)
    config = ("evaluation.check_sets", "evaluation.check_set_pool", "track_facts", "domains")
    resources = Resources(device="gpu", hold_slot=False)
    prepares = CheckFiles

    def lineage(self, run: StageRun) -> Lineage:
        check_files = [resolve_location(f) for f in run.section("evaluation").check_sets]
        run.prepared = CheckFiles(check_files)
        return Lineage(models={"experts": [run.registry().lineage(s) for s in run.models.experts]},
                       extra={"check_sets": [sha256_json(Path(f).read_text(encoding="utf-8")) for f in check_files]})

    def _score(self, run: StageRun, caches: list[EmbeddingCache], bench: str, labels: str, queries: list[dict],
               gallery: list[dict], gallery_vectors: Callable[[EmbeddingCache], np.ndarray],
               qrels: dict[str, set[str]], gallery_facts: list[dict[str, list[str]]]) -> list[dict[str, Any]]:
        """Every expert's metrics on one benchmark; ``gallery_vectors(cache)`` gives the gallery's
        vectors through that expert's embedding cache (images decoded only on a miss);
        ``gallery_facts``: each image's track facts, for an expert with track slots (as in MECF)."""
        registry = run.registry()
        rows = []
        for spec, cache in zip(run.models.experts, caches, strict=True):
            expert = registry.expert(spec)
            texts = [q["text"] for q in queries]
            scored = score_vectors(expert.encode_text(texts), queries, gallery_vectors(cache),
                                   [g["image_id"] for g in gallery], [g["domain"] for g in gallery], qrels,
                                   getattr(expert, "track_slots", None), gallery_facts)
            for domain, metrics in means_by_domain(scored, metric_names()).items():
                n = int(metrics.pop("queries"))
                rows += [{"benchmark": bench, "labels": labels, "expert": f"{spec.backend}:{spec.model_id}",
                          "domain": domain, "metric": m, "value": v, "queries": n} for m, v in metrics.items()]
        return rows

    def run(self, run: StageRun) -> Work:
        qrels_rows = run.input("benchmark/qrels").rows(["query_id", "image_id", "relevant", "verified"])
        verified: dict[str, set[str]] = {}
        for r in qrels_rows:
            if r["verified"] and r["relevant"]:
                verified.setdefault(r["query_id"], set()).add(r["image_id"])
        caches = expert_caches(run.ctx.base, run.registry(), run.models.experts)
        rows = self._benchmark_rows(run, caches, verified) if verified else []
        check_rows, skipped = self._check_set_rows(run, caches)
        return Work.one({"evaluation": pa.Table.from_pylist(rows + check_rows, schema=EVALUATION)},
                        {"input_rows": len(qrels_rows), "accepted": len(rows) + len(check_rows),
                         "pending_review": sum(not r["verified"] for r in qrels_rows),
                         "verified_queries": len(verified), "embedded": sum(c.embedded for c in caches),
                         "check_sets_skipped": skipped})

    def _benchmark_rows(self, run: StageRun, caches: list[EmbeddingCache],
                        verified: dict[str, set[str]]) -> list[dict[str, Any]]:
        """Every expert's metrics on the built benchmark's reviewed queries (its verified qrels)."""
        queries = run.input("benchmark/queries").rows(["query_id", "domain", "text"])
        bench_gallery = run.input("benchmark/gallery")
        gallery = bench_gallery.rows(["image_id", "domain"])  # no bytes: the caches stream them per shard
        tracks = track_facts(run.input("accepted"), [g["image_id"] for g in gallery], run.section("track_facts"),
                             run.domains)
        return self._score(run, caches, f"{run.ctx.flow_name}/{run.profile_name}", "verified", queries, gallery,
                           lambda cache: cache.embed_artifact(bench_gallery, ["image_id"])[1], verified,
                           [tracks.get(g["image_id"], {}) for g in gallery])

    def _check_set_rows(self, run: StageRun, caches: list[EmbeddingCache]) -> tuple[list[dict[str, Any]], list[str]]:
        """Every expert's metrics on each check set the stage prepared; the check sets with no query
        of this profile's domains, skipped (each with why)."""
        rows: list[dict[str, Any]] = []
        skipped: list[str] = []
        check_files: CheckFiles = run.prepared
        pool = resolve_location(run.section("evaluation").check_set_pool)
        for path in check_files.paths:
            check = restrict_to(load_check_set(pool, Path(path)), run.domains.names)
            data = load_check_yaml(Path(path))
            if not check.queries:
                skipped.append(f"{path}: no query of this profile's domains")
                continue
            queries, gallery_ids, gallery_domains, qrels = check_queries(check)
            gallery = [{"image_id": i, "domain": d} for i, d in zip(gallery_ids, gallery_domains, strict=True)]
            assert check.gallery_ids is not None  # load_check_set hashes every crop it reads
            rows += self._score(run, caches, f"check-set:{data.get('name', Path(path).stem)}", "verified", queries,
                                gallery, lambda cache, check=check: cache.embed(
                                    check.gallery_ids, lambda pos: [check.gallery_images[p] for p in pos]), qrels,
                                gallery_track_facts(check, run.domains, run.section("track_facts")))
        return rows, skipped

    def report(self, run: StageRun, result: StageResult) -> Report:
        out = run.output_artifact("evaluation")
        table, stats = out.to_pandas(), result.stats
        wide = [{"benchmark": b, "labels": lab, "expert": e, "domain": d,
                 **{r.metric: round(r.value, 4) for r in g.itertuples()}}
                for (b, lab, e, d), g in table.groupby(["benchmark", "labels", "expert", "domain"])] \
            if len(table) else []
        if not stats.get("verified_queries"):
            wide.append({"benchmark": f"{run.ctx.flow_name}/{run.profile_name}", "labels": "pending-review",
                         "expert": "-", "domain": "all",
                         "note": f"{stats.get('pending_review', 0)} MECF candidates await review"})
        lines = [f"evaluate: {w['benchmark']} [{w['labels']}] {w['expert']} {w['domain']}: "
                 + ", ".join(f"{k}={v}" for k, v in w.items() if k.startswith(("mAP", "R@", "note"))) for w in wide]
        lines += [f"evaluate: check set {s} (skipped)" for s in stats.get("check_sets_skipped", [])]
        return Report(tables=[("evaluation", wide or [{"benchmark": "-"}],
                               "Zero-shot retrieval per expert and domain (verified labels only)")],
                      log="\n".join(lines))
