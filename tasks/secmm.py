"""build-secmm stages after denoise: caption pool → statistics → DAP queries → CGDS gallery →
MECF candidates → benchmark export → evaluation. Each is a Prefect task over plain functions."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from models.backends.interfaces import ChatMessage, GenerationRequest
from models.backends.registry import BUNDLED_LLM, ModelRegistry, spec_lineage
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde import caption_stats, cgds, dap, labels, mecf, sentence_checks
from rde.caption_pool import IMAGE_STAGE, SENTENCE_STAGE, pool_caption
from rde.embedding_cache import EmbeddingCache
from rde.evaluation import evaluate_expert
from rde.expert_check import load_check_set, load_check_yaml
from rde.image_decoding import decode_rgb
from storage import Artifact, content_key
from storage.hashing import sha256_json
from storage.locations import resolve_location
from storage.schemas import (
    CANDIDATES,
    CAPTION_STATS,
    CAPTIONS,
    EVALUATION,
    GALLERY,
    QRELS,
    QUERIES,
    SAMPLING,
    TEXT_REJECTS,
)
from tasks import sharded
from tasks.context import RunContext
from tasks.reporting import log, publish_markdown, publish_table, stage_table

# Each stage's own version: bump one when that stage changes what it writes; it reruns with what
# reads its output, and nothing upstream (caption-pool 4: repeated sentences, verbs without object
# and colours without noun dropped; dap 5: a combination needs grammar_min_pair_count captions;
# mecf 4: the attribute expert measures garment colours on the GrabCut person mask).
VERSIONS = {"caption-pool": "4", "caption-stats": "3", "dap": "5", "cgds": "3", "mecf": "4", "export": "3",
            "evaluate": "3"}


def _query_generator_spec(ctx: RunContext) -> ModelSpec:
    return ctx.profile.models.query_generator or ModelSpec(**BUNDLED_LLM)


# -- caption pool ---------------------------------------------------------------------------------

@task(name="caption-pool", cache_policy=NO_CACHE)
def caption_pool_task(ctx: RunContext, accepted_url: str) -> sharded.StageResult:
    """Captions for DAP statistics: a user caption file, or the profile's first generator on a
    seeded sample of the denoised pool (per domain)."""
    p = ctx.profile
    prompt = load_prompt("caption_pool")
    gen_spec = p.models.generators[0] if p.models.generators else None
    caption_file = resolve_location(p.queries.caption_file) if p.queries.caption_file else None
    key = content_key(stage="caption-pool", version=VERSIONS["caption-pool"],
                      accepted=Artifact(accepted_url).manifest().fingerprint,
                      generator=spec_lineage(gen_spec), prompt=prompt.identity, file=caption_file,
                      sample=p.queries.caption_sample_per_domain, max_tokens=p.queries.caption_max_tokens,
                      seed=p.queries.seed)
    outs = [sharded.Output("captions", ctx.artifact_url("caption_pool"), "captions", CAPTIONS),
            sharded.Output("rejects", ctx.artifact_url("caption_pool_rejects"), "text_rejects", TEXT_REJECTS)]

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        if caption_file:
            rows = _captions_from_file(Path(caption_file), p.input.default_domain)
            return {"captions": pa.Table.from_pylist(rows, schema=CAPTIONS),
                    "rejects": TEXT_REJECTS.empty_table()}, {"input_rows": len(rows), "accepted": len(rows)}
        if gen_spec is None:
            raise ValueError("queries: no caption_file and no models.generators to caption the pool with")
        generator = ModelRegistry(p.models).generator(gen_spec)
        rows = Artifact(accepted_url).rows(["image_id", "domain", "image_bytes"])
        rng = np.random.default_rng(p.queries.seed)
        captions, rejects = [], []
        generic = set(prompt.extras.get("generic_words", []))
        measured = getattr(generator, "measured_facts", None)  # composed captioners expose their facts
        generated = clean_before = rendered = 0
        for domain in sorted({r["domain"] for r in rows}):
            mine = [r for r in rows if r["domain"] == domain]
            pick = rng.choice(len(mine), size=min(p.queries.caption_sample_per_domain, len(mine)), replace=False)
            chosen = [mine[i] for i in sorted(pick)]
            images = {r["image_id"]: decode_rgb(r["image_bytes"]) for r in chosen}
            requests = [GenerationRequest(r["image_id"], [ChatMessage("user", prompt.templates[domain],
                                                                      [images[r["image_id"]]])],
                                          max_tokens=p.queries.caption_max_tokens, temperature=0.0)
                        for r in chosen]
            generated += len(requests)
            results = generator.generate(requests)
            # complete sentences only, and (where the generator measured facts) only what was measured
            facts = [measured([images[r.request_id]])[0] if measured else None for r in results]
            checks = sentence_checks.check_captions([r.text if r.ok else "" for r in results],
                                                    [f.allowed if f else None for f in facts], generic,
                                                    int(prompt.extras.get("restart_ngram", 3)),
                                                    needs_object=prompt.extras.get("needs_object", []))
            from_facts = prompt.extras.get("from_facts", {}).get(domain, {})
            for res, check, fact in zip(results, checks, facts, strict=True):
                decided = pool_caption(res, check, fact.values if fact else None, from_facts, domain,
                                       prompt.identity)
                captions += [decided.caption] if decided.caption else []
                rejects += decided.rejects
                clean_before += decided.clean
                rendered += decided.rendered
        image_rows = [r for r in rejects if r["stage"] == IMAGE_STAGE]
        stats = {"input_rows": generated, "accepted": len(captions),
                 "rejected": dict(Counter(r["reason"] for r in image_rows)),
                 "dropped_sentences": dict(Counter(r["reason"] for r in rejects if r["stage"] == SENTENCE_STAGE)),
                 "generated_captions_clean": clean_before, "rendered_from_facts": rendered}
        return {"captions": pa.Table.from_pylist(captions, schema=CAPTIONS),
                "rejects": pa.Table.from_pylist(rejects, schema=TEXT_REJECTS)}, stats

    result = sharded.run_single(ctx, "caption-pool", outs, key, compute, balance=True,
                                upstream=[Artifact(accepted_url)],
                                models={"generator": spec_lineage(gen_spec)},
                                prompt_versions={"caption_pool": prompt.identity})
    log(f"caption-pool: {'skipped, ' if result.skipped else ''}{result.accepted}/{result.input_rows} captions kept")
    return result




def _captions_from_file(path: Path, domain: str) -> list[dict[str, Any]]:
    """CUHK-PEDES-style JSON: a list of {"file_path" or "id", "captions": [...], optional "domain"}."""
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = []
    for item in data:
        for i, text in enumerate(item.get("captions", [])):
            ident = str(item.get("id", item.get("file_path", len(rows))))
            rows.append({"image_id": f"{ident}#{i}", "domain": item.get("domain", domain), "text": text,
                         "q_txt": None, "generator": "caption-file", "prompt": path.name})
    return rows


# -- statistics + DAP -----------------------------------------------------------------------------

@task(name="dap-queries", cache_policy=NO_CACHE)
def dap_task(ctx: RunContext, captions_url: str) -> tuple[sharded.StageResult, sharded.StageResult]:
    """POS statistics of the caption pool, then Distribution-Aware Prompting per domain."""
    p = ctx.profile
    captions = Artifact(captions_url)
    stats_key = content_key(stage="caption-stats", version=VERSIONS["caption-stats"],
                            captions=captions.manifest().fingerprint)
    stats_out = [sharded.Output("stats", ctx.artifact_url("caption_stats"), "caption_stats", CAPTION_STATS)]

    def compute_stats() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        rows = Artifact(captions_url).rows(["domain", "text"])
        out = []
        for domain in sorted({r["domain"] for r in rows}):
            freqs = caption_stats.pos_frequencies([r["text"] for r in rows if r["domain"] == domain])
            out += [{"domain": domain, "pos": pos, "word": w, "count": c}
                    for pos, counter in freqs.items() for w, c in counter.most_common()]
        return {"stats": pa.Table.from_pylist(out, schema=CAPTION_STATS)}, {"input_rows": len(rows),
                                                                             "accepted": len(out)}

    stats_result = sharded.run_single(ctx, "caption-stats", stats_out, stats_key, compute_stats, upstream=[captions],
                                      models={"pos_tagger": "en_core_web_sm 3.8.0"})
    stats_rows = Artifact(stats_out[0].url).to_pandas()

    registry = ModelRegistry(p.models)
    gen_spec = _query_generator_spec(ctx)
    prompts = {d.name: load_prompt(f"dap_{d.name}") for d in p.domains}
    safety = load_prompt("query_safety")
    key = content_key(stage="dap", version=VERSIONS["dap"], stats=Artifact(stats_out[0].url).manifest().fingerprint,
                      captions=captions.manifest().fingerprint, queries=p.queries.model_dump(),
                      generator=spec_lineage(gen_spec),
                      encoder=spec_lineage(p.models.text_encoder), prompts={k: v.identity for k, v in prompts.items()},
                      safety=safety.identity)
    outs = [sharded.Output("queries", ctx.artifact_url("queries"), "queries", QUERIES),
            sharded.Output("rejects", ctx.artifact_url("query_rejects"), "text_rejects", TEXT_REJECTS)]

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        generator = registry.generator(gen_spec)
        encoder = registry.text_encoder()
        caption_rows = Artifact(captions_url).rows(["domain", "text"])
        queries, rejects, requests_seen = [], [], []
        lines_in = 0  # the stage's input, counted as read: each line returned, each failed request
        for domain, prompt in prompts.items():
            mine = stats_rows[stats_rows.domain == domain]
            stats = {pos: Counter(dict(zip(g.word, g["count"], strict=True))) for pos, g in mine.groupby("pos")}
            texts = [r["text"] for r in caption_rows if r["domain"] == domain]
            made = dap.domain_queries(domain, prompt, stats, texts, generator, encoder, p.queries,
                                      safety.extras["blocked"])
            queries += made.queries
            rejects += made.rejects
            requests_seen += made.requests
            lines_in += made.lines_in
        mean_keywords = sum(len(q["keywords"]) for q in queries) / len(queries) if queries else 0.0
        stats_out_ = {"input_rows": lines_in, "accepted": len(queries),
                      "rejected": dict(Counter(r["reason"] for r in rejects)),
                      "mean_keywords_per_query": round(mean_keywords, 3), "requests": requests_seen}
        return {"queries": pa.Table.from_pylist(queries, schema=QUERIES),
                "rejects": pa.Table.from_pylist(rejects, schema=TEXT_REJECTS)}, stats_out_

    result = sharded.run_single(ctx, "dap", outs, key, compute, balance=True,
                                upstream=[Artifact(stats_out[0].url), captions],
                                models={"generator": spec_lineage(gen_spec)},
                                prompt_versions={**{f"dap_{k}": v.identity for k, v in prompts.items()},
                                                 "query_safety": safety.identity})
    mean_keywords = Artifact(outs[0].url).manifest().stats.get("mean_keywords_per_query")
    log(f"dap: {'skipped, ' if result.skipped else ''}{result.accepted} queries kept of {result.input_rows} "
        f"generated lines, {mean_keywords} sampled keywords per kept query, rejected {result.rejected}")
    return stats_result, result


# -- CGDS -----------------------------------------------------------------------------------------

@task(name="cgds", cache_policy=NO_CACHE)
def cgds_task(ctx: RunContext, accepted_url: str) -> sharded.StageResult:
    """Embed the denoised pool, k-means per domain, sample per cluster, keep the target category."""
    p = ctx.profile
    registry = ModelRegistry(p.models)
    embedder = registry.image_embedder()
    cache = EmbeddingCache(resolve_location(p.artifacts_root), embedder)
    key = content_key(stage="cgds", version=VERSIONS["cgds"], accepted=Artifact(accepted_url).manifest().fingerprint,
                      sampling=p.sampling.model_dump(), embedder=cache.identity)
    outs = [sharded.Output("gallery", ctx.artifact_url("gallery"), "gallery", GALLERY),
            sharded.Output("sampling", ctx.artifact_url("sampling"), "sampling", SAMPLING)]

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        rows = Artifact(accepted_url).rows(["image_id", "domain", "identity", "source", "width", "height",
                                             "target_count", "image_bytes"])
        ids = [r["image_id"] for r in rows]
        vectors = cache.embed(ids, lambda pos: [decode_rgb(rows[i]["image_bytes"]) for i in pos])
        drawn = cgds.sample_gallery(rows, vectors, p.sampling)
        stats = {"input_rows": len(rows), "accepted": len(drawn.gallery),
                 "rejected": dict(Counter(s["reason"] for s in drawn.sampling if s["reason"])),
                 "clusters": drawn.clusters}
        return {"gallery": pa.Table.from_pylist(drawn.gallery, schema=GALLERY),
                "sampling": pa.Table.from_pylist(drawn.sampling, schema=SAMPLING)}, stats

    result = sharded.run_single(ctx, "cgds", outs, key, compute, upstream=[Artifact(accepted_url)],
                                models={"image_embedder": cache.identity}, config={"sampling": p.sampling.model_dump()})
    clusters = Artifact(outs[0].url).manifest().stats.get("clusters", [])
    publish_table(f"{ctx.flow_name}-cgds-clusters", clusters or [{"domain": "-", "cluster": 0, "size": 0}],
                  "CGDS: cluster sizes and how many images each contributed to the gallery")
    log(f"cgds: {'skipped, ' if result.skipped else ''}gallery {result.accepted} of {result.input_rows} images, "
        f"{len(clusters)} clusters, embedded {cache.embedded} new images")
    return result


# -- MECF -----------------------------------------------------------------------------------------

@task(name="mecf", cache_policy=NO_CACHE)
def mecf_task(ctx: RunContext, queries_url: str, gallery_url: str) -> sharded.StageResult:
    """Every expert retrieves its top-K per query within the query's domain; keep the union (Eq. 1)."""
    p = ctx.profile
    key = content_key(stage="mecf", version=VERSIONS["mecf"], queries=Artifact(queries_url).manifest().fingerprint,
                      gallery=Artifact(gallery_url).manifest().fingerprint, retrieval=p.retrieval.model_dump(),
                      experts=[spec_lineage(s) for s in p.models.experts])
    outs = [sharded.Output("candidates", ctx.artifact_url("candidates"), "candidates", CANDIDATES)]
    per_expert_counts: dict[str, int] = {}

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        registry = ModelRegistry(p.models)
        queries = Artifact(queries_url).rows(["query_id", "domain", "text"])
        gallery = Artifact(gallery_url).rows(["image_id", "domain", "image_bytes"])
        images = [decode_rgb(g["image_bytes"]) for g in gallery]
        rows = []
        for domain in sorted({q["domain"] for q in queries}):
            q_idx = [i for i, q in enumerate(queries) if q["domain"] == domain]
            g_idx = [i for i, g in enumerate(gallery) if g["domain"] == domain]
            if not q_idx or not g_idx:
                continue
            per_expert = {}
            for spec in p.models.experts:
                expert = registry.expert(spec)
                name = f"{spec.backend}:{spec.model_id}"
                qv = expert.encode_text([queries[i]["text"] for i in q_idx])
                gv = expert.encode_image([images[i] for i in g_idx])
                per_expert[name] = mecf.topk(qv, gv, p.retrieval.top_k, p.retrieval.index_above)
                per_expert_counts[name] = per_expert_counts.get(name, 0) + int(per_expert[name][0].size)
            for cand in mecf.union_candidates(per_expert):
                names = sorted(cand.ranks)
                rows.append({"query_id": queries[q_idx[cand.query]]["query_id"],
                             "image_id": gallery[g_idx[cand.item]]["image_id"], "domain": domain,
                             "experts": names, "ranks": [cand.ranks[n] for n in names],
                             "scores": [cand.scores[n] for n in names], "best_rank": min(cand.ranks.values())})
        stats = {"input_rows": len(queries), "accepted": len(rows), "per_expert_candidates": per_expert_counts,
                 "union_candidates": len(rows)}
        return {"candidates": pa.Table.from_pylist(rows, schema=CANDIDATES)}, stats

    result = sharded.run_single(ctx, "mecf", outs, key, compute, upstream=[Artifact(queries_url),
                                                                          Artifact(gallery_url)],
                                models={"experts": [spec_lineage(s) for s in p.models.experts]})
    stats = Artifact(outs[0].url).manifest().stats
    table = [{"expert": k, "candidates": v} for k, v in stats.get("per_expert_candidates", {}).items()]
    table.append({"expert": "union (Eq. 1)", "candidates": stats.get("union_candidates", 0)})
    publish_table(f"{ctx.flow_name}-mecf", table, "MECF: top-K candidates per expert and their union")
    log(f"mecf: {'skipped, ' if result.skipped else ''}{table}")
    return result


# -- export + evaluation --------------------------------------------------------------------------

@task(name="benchmark-export", cache_policy=NO_CACHE)
def export_task(ctx: RunContext, queries_url: str, gallery_url: str, candidates_url: str) -> sharded.StageResult:
    """queries / gallery / qrels artifacts, a dataset card and the review files. Candidates people
    decided on (the ``decisions`` artifact, filled by ``rde labels import``) become verified qrels;
    the others stay ``verified = false`` (the "unverified" benchmark)."""
    decisions = Artifact(ctx.artifact_url("decisions"))
    decided = decisions.manifest().fingerprint if decisions.is_complete() else None
    key = content_key(stage="export", version=VERSIONS["export"], queries=Artifact(queries_url).manifest().fingerprint,
                      gallery=Artifact(gallery_url).manifest().fingerprint,
                      candidates=Artifact(candidates_url).manifest().fingerprint, decisions=decided)
    bench = ctx.artifact_url("benchmark")
    outs = [sharded.Output("queries", f"{bench}/queries", "queries", QUERIES),
            sharded.Output("gallery", f"{bench}/gallery", "gallery", GALLERY),
            sharded.Output("qrels", f"{bench}/qrels", "qrels", QRELS)]

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        queries = pa.concat_tables([t for _, t in Artifact(queries_url).iter_shards()])
        gallery = pa.concat_tables([t for _, t in Artifact(gallery_url).iter_shards()])
        cands = Artifact(candidates_url).rows(["query_id", "image_id"])
        made = {(d["query_id"], d["image_id"]): d for d in Artifact(decisions.url).rows(list(QRELS.names))} \
            if decided else {}
        qrels = []
        for c in cands:
            d = made.get((c["query_id"], c["image_id"]))
            qrels.append({"query_id": c["query_id"], "image_id": c["image_id"],
                          "relevant": bool(d["relevant"]) if d else True, "verified": d is not None,
                          "annotator": d["annotator"] if d else None, "decided_at": d["decided_at"] if d else None})
        verified = sum(q["verified"] for q in qrels)
        stats = {"input_rows": len(cands), "accepted": len(qrels), "verified": verified,
                 "decisions_not_candidates": len(made) - verified}
        return {"queries": queries, "gallery": gallery, "qrels": pa.Table.from_pylist(qrels, schema=QRELS)}, stats

    result = sharded.run_single(ctx, "export", outs, key, compute, upstream=[Artifact(candidates_url)],
                                main_output="qrels")
    card = dataset_card(ctx, bench)
    fs_path = Path(bench)
    if "://" not in bench:
        fs_path.mkdir(parents=True, exist_ok=True)
        (fs_path / "README.md").write_text(card, encoding="utf-8")
        if not result.skipped or not (fs_path / "review" / "review.html").exists():
            write_review_files(ctx, candidates_url, queries_url, gallery_url, fs_path / "review")
    publish_markdown(f"{ctx.flow_name}-dataset-card", card, "Benchmark dataset card")
    return result


def write_review_files(ctx: RunContext, candidates_url: str, queries_url: str, gallery_url: str,
                       folder: Path) -> None:
    """Label Studio import (tasks + config + image files) and the HTML review page."""
    candidates = Artifact(candidates_url).rows(["query_id", "image_id", "domain", "experts", "best_rank"])
    queries = {q["query_id"]: q for q in Artifact(queries_url).rows(["query_id", "domain", "text"])}
    gallery = Artifact(gallery_url).rows(["image_id", "image_bytes"])
    paths = labels.write_review_images(gallery, folder / "images")
    urls = {k: f"/data/local-files/?d={p.resolve()}" for k, p in paths.items()}
    tasks_ = labels.label_studio_tasks(candidates, queries, urls)
    (folder / "label_studio_tasks.json").write_text(json.dumps(tasks_, indent=1), encoding="utf-8")
    (folder / "label_config.xml").write_text(labels.LABEL_STUDIO_CONFIG, encoding="utf-8")
    page = labels.review_page(candidates, queries, {g["image_id"]: g["image_bytes"] for g in gallery},
                              f"{ctx.flow_name} / {ctx.profile.name}")
    (folder / "review.html").write_text(page, encoding="utf-8")
    log(f"review: {len(candidates)} candidates → {folder / 'review.html'} and {folder / 'label_studio_tasks.json'}")


def dataset_card(ctx: RunContext, bench: str) -> str:
    queries = Artifact(f"{bench}/queries").to_pandas(["query_id", "domain"])
    gallery = Artifact(f"{bench}/gallery").to_pandas(["image_id", "domain"])
    qrels = Artifact(f"{bench}/qrels").to_pandas()
    per_query = qrels.groupby("query_id").size()
    low, mid, high = (int(per_query.min()), float(per_query.median()), int(per_query.max())) if len(per_query) \
        else (0, 0.0, 0)
    lines = [f"# SecMM-style benchmark ({ctx.profile.name} profile)", "",
             "Text-to-image multi-match retrieval: `queries`, `gallery`, `qrels` (Parquet).", "",
             "```python", "from datasets import load_dataset", "",
             "# three tables with different columns: load each on its own",
             *[f'{name} = load_dataset("parquet", data_files="{bench}/{name}/*.parquet", split="train")'
               for name in ("queries", "gallery", "qrels")], "```", "",
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


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(ctx: RunContext, bench_url: str) -> sharded.StageResult:
    """mAP@10/20/30 and R@1/5/10 per domain for every configured expert, on the built benchmark's
    verified qrels (none until people review the candidates: reported as pending) and on the
    profile's hand-labelled check sets."""
    p = ctx.profile
    check_files = [resolve_location(f) for f in p.evaluation.check_sets]
    key = content_key(stage="evaluate", version=VERSIONS["evaluate"],
                      qrels=Artifact(f"{bench_url}/qrels").manifest().fingerprint,
                      experts=[spec_lineage(s) for s in p.models.experts], check_sets=[
                          sha256_json(Path(f).read_text(encoding="utf-8")) for f in check_files],
                      pool=p.evaluation.check_set_pool)
    outs = [sharded.Output("evaluation", ctx.artifact_url("evaluation"), "evaluation", EVALUATION)]

    def score(bench: str, labels: str, queries: list[dict], gallery: list[dict], images: list[np.ndarray],
              qrels: dict[str, set[str]]) -> list[dict[str, Any]]:
        registry = ModelRegistry(p.models)
        rows = []
        for spec in p.models.experts:
            expert = registry.expert(spec)
            res = evaluate_expert(expert.encode_text([q["text"] for q in queries]), [q["domain"] for q in queries],
                                  [q["query_id"] for q in queries], expert.encode_image(images),
                                  [g["domain"] for g in gallery], [g["image_id"] for g in gallery], qrels)
            for domain, metrics in res.items():
                n = int(metrics.pop("queries"))
                rows += [{"benchmark": bench, "labels": labels, "expert": f"{spec.backend}:{spec.model_id}",
                          "domain": domain, "metric": m, "value": v, "queries": n} for m, v in metrics.items()]
        return rows

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        qrels_rows = Artifact(f"{bench_url}/qrels").rows(["query_id", "image_id", "relevant", "verified"])
        verified: dict[str, set[str]] = {}
        for r in qrels_rows:
            if r["verified"] and r["relevant"]:
                verified.setdefault(r["query_id"], set()).add(r["image_id"])
        pending = sum(not r["verified"] for r in qrels_rows)
        if verified:
            queries = Artifact(f"{bench_url}/queries").rows(["query_id", "domain", "text"])
            gallery = Artifact(f"{bench_url}/gallery").rows(["image_id", "domain", "image_bytes"])
            rows += score(f"{ctx.flow_name}/{p.name}", "verified", queries, gallery,
                          [decode_rgb(g["image_bytes"]) for g in gallery], verified)
        for path in check_files:
            check = load_check_set(resolve_location(p.evaluation.check_set_pool), Path(path))
            data = load_check_yaml(Path(path))
            queries = [{"query_id": q["id"], "domain": q["domain"], "text": q["text"]} for q in data["queries"]]
            gallery = [{"image_id": str(i), "domain": d} for i, d in enumerate(check.gallery_domains)]
            qrels = {q["query_id"]: {str(i) for i, ident in enumerate(check.gallery_identities) if ident in rel}
                     for q, rel in zip(queries, check.relevant, strict=True)}
            rows += score(f"check-set:{data.get('name', Path(path).stem)}", "verified", queries, gallery,
                          check.gallery_images, qrels)
        return {"evaluation": pa.Table.from_pylist(rows, schema=EVALUATION)}, {
            "input_rows": len(qrels_rows), "accepted": len(rows), "pending_review": pending,
            "verified_queries": len(verified)}

    result = sharded.run_single(ctx, "evaluate", outs, key, compute, upstream=[Artifact(f"{bench_url}/qrels")])
    table = Artifact(outs[0].url).to_pandas()
    stats = Artifact(outs[0].url).manifest().stats
    wide = [{"benchmark": b, "labels": lab, "expert": e, "domain": d,
             **{r.metric: round(r.value, 4) for r in g.itertuples()}}
            for (b, lab, e, d), g in table.groupby(["benchmark", "labels", "expert", "domain"])] if len(table) else []
    if not stats.get("verified_queries"):
        wide.append({"benchmark": f"{ctx.flow_name}/{p.name}", "labels": "pending-review", "expert": "-",
                     "domain": "all", "note": f"{stats.get('pending_review', 0)} MECF candidates await review"})
    publish_table(f"{ctx.flow_name}-evaluation", wide or [{"benchmark": "-"}],
                  "Zero-shot retrieval per expert and domain (verified labels only)")
    for w in wide:
        log(f"evaluate: {w['benchmark']} [{w['labels']}] {w['expert']} {w['domain']}: "
            + ", ".join(f"{k}={v}" for k, v in w.items() if k.startswith(("mAP", "R@", "note"))))
    return result


def publish(result: sharded.StageResult, flow_name: str) -> None:
    """The stage table artifact (rows in, kept, rejected by reason) under a stable key."""
    publish_table(f"{flow_name}-{result.stage}", stage_table(result.stage, result.input_rows, result.accepted,
                                                             result.rejected, result.skipped),
                  f"{result.stage}: rows in, kept, rejected by reason")


