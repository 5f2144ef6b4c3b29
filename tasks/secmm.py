"""build-secmm stages after denoise: caption pool → statistics → DAP queries → CGDS gallery →
MECF candidates → benchmark export → evaluation. Each is a stage of the stage contract
(``tasks/stage.py``) over the paper logic in ``rde/``; ``tasks/runner.py`` runs them."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from models.backends.interfaces import ChatMessage, GenerationRequest
from models.backends.registry import BUNDLED_LLM, spec_lineage
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde.common import caption_stats
from rde.common.dataset_cards import card_folder_note, configs_header, loading_snippet
from rde.common.embedding_cache import EmbeddingCache, ExpertImages
from rde.common.evaluation import evaluate_expert
from rde.common.expert_check import gallery_track_facts, load_check_set, load_check_yaml
from rde.common.image_decoding import decoded_images
from rde.common.profiles import ReviewSpec
from rde.common.text_diversity import diversity_by_domain, diversity_line
from rde.common.topk import topk
from rde.common.track_context import track_facts
from rde.common.track_slots import fuse_track_slots
from rde.secmm import cgds, dap, mecf, sentence_checks
from rde.secmm.caption_pool import IMAGE_STAGE, SENTENCE_STAGE, pool_caption
from rde.secmm.review_site import ReviewFiles, build_review
from storage import Artifact
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
    REJECTS,
    SAMPLING,
)
from tasks.context import RunContext
from tasks.reporting import log
from tasks.sharded import StageResult
from tasks.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write

# -- caption pool ---------------------------------------------------------------------------------

class CaptionPool(Stage):
    """Captions for DAP statistics: a user caption file, or the profile's first generator on a
    seeded sample of the denoised pool (per domain)."""

    name = "caption-pool"
    # 4: repeated sentences, verbs without object and colours without noun dropped; 5: the images'
    # track facts (motion, direction, distance) go to the captioner and into rendered captions;
    # 6: garbled sentences (control or replacement characters) dropped
    version = "6"
    reads = ("accepted",)
    writes = (Write("captions", "captions", CAPTIONS, folder="caption_pool"),
              Write("rejects", "rejects", REJECTS, folder="caption_pool_rejects", rejects=True))
    config = ("queries.caption_file", "queries.caption_sample_per_domain", "queries.caption_max_tokens",
              "queries.seed", "input.default_domain", "track_facts")
    resources = Resources(device="gpu", hold_slot=False)  # the captioner (an MLLM in production)
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        queries = run.section("queries")
        prompt = load_prompt("caption_pool")
        gen_spec = run.models.generators[0] if run.models.generators else None
        caption_file = resolve_location(queries.caption_file) if queries.caption_file else None
        run.prepared.update(prompt=prompt, gen_spec=gen_spec, caption_file=caption_file)
        return Lineage(models={"generator": run.registry().lineage(gen_spec)},
                       prompts={"caption_pool": prompt.identity}, extra={"file": caption_file})

    def run(self, run: StageRun) -> Work:
        q, prompt, gen_spec = run.section("queries"), run.prepared["prompt"], run.prepared["gen_spec"]
        if run.prepared["caption_file"]:
            path = Path(run.prepared["caption_file"])
            captions = pa.Table.from_pylist(_captions_from_file(path, run.section("input").default_domain),
                                            schema=CAPTIONS)
            return Work.one({"captions": captions, "rejects": REJECTS.empty_table()},
                            {"input_rows": _file_caption_count(path), "accepted": captions.num_rows})
        if gen_spec is None:
            raise ValueError("queries: no caption_file and no models.generators to caption the pool with")
        generator = run.registry().generator(gen_spec)
        accepted = run.input("accepted")
        rows = accepted.rows(["image_id", "domain"])  # no bytes: only the sampled images are read
        rng = np.random.default_rng(q.seed)
        captions, rejects = [], []
        generic = set(prompt.extras.get("generic_words", []))
        measured = getattr(generator, "measured_facts", None)  # composed captioners expose their facts
        generated = clean_before = rendered = 0
        for domain in sorted({r["domain"] for r in rows}):
            mine = [r for r in rows if r["domain"] == domain]
            pick = rng.choice(len(mine), size=min(q.caption_sample_per_domain, len(mine)), replace=False)
            chosen = [mine[i] for i in sorted(pick)]
            images = decoded_images(accepted, [r["image_id"] for r in chosen])
            tracks = track_facts(accepted, [r["image_id"] for r in chosen], run.section("track_facts"))
            requests = [GenerationRequest(r["image_id"], [ChatMessage("user", prompt.templates[domain],
                                                                      [images[r["image_id"]]],
                                                                      [tracks.get(r["image_id"], {})])],
                                          max_tokens=q.caption_max_tokens, temperature=0.0)
                        for r in chosen]
            generated += len(requests)
            results = generator.generate(requests)
            # complete sentences only, and (where the generator measured facts) only what was measured
            facts = [measured([images[r.request_id]], [tracks.get(r.request_id, {})])[0] if measured else None
                     for r in results]
            checks = sentence_checks.check_captions([r.text if r.ok else "" for r in results],
                                                    [f.allowed if f else None for f in facts], generic,
                                                    int(prompt.extras.get("restart_ngram", 3)),
                                                    needs_object=prompt.extras.get("needs_object", []))
            from_facts = prompt.extras.get("from_facts", {}).get(domain, {})
            for res, check, fact in zip(results, checks, facts, strict=True):
                decided = pool_caption(res, check, fact.values if fact else None, from_facts, domain,
                                       prompt.identity, prompt.extras)
                captions += [decided.caption] if decided.caption else []
                rejects += decided.rejects
                clean_before += decided.clean
                rendered += decided.rendered
        image_rows = [r for r in rejects if r["stage"] == IMAGE_STAGE]
        stats = {"input_rows": generated, "accepted": len(captions),
                 "rejected": dict(Counter(r["reason"] for r in image_rows)),
                 "dropped_sentences": dict(Counter(r["reason"] for r in rejects if r["stage"] == SENTENCE_STAGE)),
                 "generated_captions_clean": clean_before, "rendered_from_facts": rendered,
                 "diversity": diversity_by_domain(captions)}
        return Work.one({"captions": pa.Table.from_pylist(captions, schema=CAPTIONS),
                         "rejects": pa.Table.from_pylist(rejects, schema=REJECTS)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(tables=[("caption-pool-diversity", stats.get("diversity") or [{"domain": "-"}],
                               "Caption pool: how varied the captions DAP samples from are, per domain")],
                      log=f"caption-pool: {result.accepted}/{result.input_rows} captions kept, sentences dropped "
                          f"{stats.get('dropped_sentences', {})}, {stats.get('rendered_from_facts', 0)} said "
                          "from the measured facts; " + diversity_line(stats.get("diversity") or []))


def _file_caption_count(path: Path) -> int:
    """The captions a caption file lists, counted apart from the rows made of them (the caption
    pool's input on that path: each ends as one row)."""
    return sum(len(item.get("captions", [])) for item in json.loads(path.read_text(encoding="utf-8")))


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

class CaptionStats(Stage):
    """POS statistics of the caption pool per domain (DSMM-TBIR Sec. 3.1: what DAP samples from)."""

    name = "caption-stats"
    version = "3"
    reads = ("caption_pool",)
    writes = (Write("stats", "caption_stats", CAPTION_STATS, folder="caption_stats"),)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"pos_tagger": "en_core_web_sm 3.8.0"})

    def run(self, run: StageRun) -> Work:
        rows = run.input("caption_pool").rows(["domain", "text"])
        out = []
        for domain in sorted({r["domain"] for r in rows}):
            freqs = caption_stats.pos_frequencies([r["text"] for r in rows if r["domain"] == domain])
            out += [{"domain": domain, "pos": pos, "word": w, "count": c}
                    for pos, counter in freqs.items() for w, c in counter.most_common()]
        return Work.one({"stats": pa.Table.from_pylist(out, schema=CAPTION_STATS)},
                        {"input_rows": len(rows), "accepted": len(out)})


class Dap(Stage):
    """Distribution-Aware Prompting per domain: sampled keywords → generated queries, checked
    (rde/secmm/dap.py) until ``queries.per_domain`` are kept."""

    name = "dap"
    # 5: a combination needs grammar_min_pair_count captions; 6: actions, diversity stats; 7: garbled lines
    version = "7"
    reads = ("caption_stats", "caption_pool")
    writes = (Write("queries", "queries", QUERIES),
              Write("rejects", "rejects", REJECTS, folder="query_rejects", rejects=True))
    config = ("queries", "domains")
    resources = Resources(device="gpu", hold_slot=False)  # the query generator and the text encoder
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        gen_spec = run.models.query_generator or ModelSpec(**BUNDLED_LLM)
        prompts = {d.name: load_prompt(f"dap_{d.name}") for d in run.section("domains")}
        safety = load_prompt("query_safety")
        run.prepared.update(gen_spec=gen_spec, prompts=prompts, safety=safety)
        return Lineage(models={"generator": run.registry().lineage(gen_spec),
                               "encoder": spec_lineage(run.models.text_encoder)},
                       prompts={**{f"dap_{k}": v.identity for k, v in prompts.items()},
                                "query_safety": safety.identity})

    def run(self, run: StageRun) -> Work:
        registry = run.registry()
        generator = registry.generator(run.prepared["gen_spec"])
        encoder = registry.text_encoder()
        stats_rows = run.input("caption_stats").to_pandas()
        caption_rows = run.input("caption_pool").rows(["domain", "text"])
        queries, rejects, requests_seen = [], [], []
        lines_in = 0  # the stage's input, counted as read: each line returned, each failed request
        for domain, prompt in run.prepared["prompts"].items():
            mine = stats_rows[stats_rows.domain == domain]
            stats = {pos: Counter(dict(zip(g.word, g["count"], strict=True))) for pos, g in mine.groupby("pos")}
            texts = [r["text"] for r in caption_rows if r["domain"] == domain]
            made = dap.domain_queries(domain, prompt, stats, texts, generator, encoder, run.section("queries"),
                                      run.prepared["safety"].extras["blocked"])
            queries += made.queries
            rejects += made.rejects
            requests_seen += made.requests
            lines_in += made.lines_in
        mean_keywords = sum(len(q["keywords"]) for q in queries) / len(queries) if queries else 0.0
        return Work.one({"queries": pa.Table.from_pylist(queries, schema=QUERIES),
                         "rejects": pa.Table.from_pylist(rejects, schema=REJECTS)},
                        {"input_rows": lines_in, "accepted": len(queries),
                         "rejected": dict(Counter(r["reason"] for r in rejects)),
                         "mean_keywords_per_query": round(mean_keywords, 3), "requests": requests_seen,
                         "diversity": diversity_by_domain(queries)})

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(tables=[("dap-diversity", stats.get("diversity") or [{"domain": "-"}],
                               "DAP: how varied the kept queries are, per domain (distinct-n, facets, length)")],
                      log=f"dap: {result.accepted} queries kept of {result.input_rows} generated lines, "
                          f"{stats.get('mean_keywords_per_query')} sampled keywords per kept query; "
                          + diversity_line(stats.get("diversity") or []))


# -- CGDS -----------------------------------------------------------------------------------------

class Cgds(Stage):
    """Embed the denoised pool, k-means per domain, sample per cluster, keep the target category."""

    name = "cgds"
    # 4: domains above sampling.minibatch_above are clustered by streaming k-means over the cached
    # vectors (rde.secmm.cgds.kmeans_streaming) instead of MiniBatchKMeans on all of them in memory
    version = "4"
    reads = ("accepted",)
    writes = (Write("gallery", "gallery", GALLERY), Write("sampling", "sampling", SAMPLING))
    config = ("sampling",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="models.image_embedder.batch_size")

    def lineage(self, run: StageRun) -> Lineage:
        cache = EmbeddingCache(run.ctx.base, run.registry().image_embedder())
        run.prepared["cache"] = cache
        return Lineage(models={"image_embedder": cache.identity})

    def run(self, run: StageRun) -> Work:
        """The draw on embeddings, then the gallery written streaming: per domain, one output shard
        per pool shard, with the drawn images' bytes copied from that pool shard (same rows and
        order as drawing over the whole pool). Memory: the pool's metadata, one shard of bytes
        while embedding the misses, and the vectors of one domain at most ``minibatch_above``
        images (k-means in memory) or of one pool shard (a larger domain, streamed: see
        ``cgds.kmeans_streaming``); never the pool's N × dim vectors."""
        cache: EmbeddingCache = run.prepared["cache"]
        accepted = run.input("accepted")
        rows, vectors = cache.index_artifact(accepted, [*cgds.GALLERY_FIELDS, "target_count"])
        drawn = cgds.draw_gallery(rows, run.section("sampling"), vectors.take, vectors.blocks)
        stats = {"input_rows": len(rows), "accepted": len(drawn.gallery),
                 "rejected": dict(Counter(s["reason"] for s in drawn.sampling if s["reason"])),
                 "clusters": drawn.clusters, "embedded": cache.embedded}
        return Work(_gallery_shards(accepted, drawn), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        clusters = stats.get("clusters", [])
        return Report(tables=[("cgds-clusters", clusters or [{"domain": "-", "cluster": 0, "size": 0}],
                               "CGDS: cluster sizes and how many images each contributed to the gallery")],
                      log=f"cgds: gallery {result.accepted} of {result.input_rows} images, {len(clusters)} "
                          f"clusters, embedded {0 if result.skipped else stats.get('embedded', 0)} new images")


def _gallery_shards(accepted: Artifact, drawn: cgds.GallerySample) -> Iterator[dict[str, pa.Table]]:
    """The gallery and sampling rows, per domain and pool shard, with the gallery's bytes read from
    that pool shard only (empty pairs skipped; at least one shard, so an empty draw is written)."""
    shard_of: dict[str, int] = {}
    for index, table in accepted.iter_shards(["image_id"]):
        for image_id in table.column("image_id").to_pylist():
            shard_of.setdefault(image_id, index)
    groups: dict[tuple[str, int], tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for s in drawn.sampling:  # input order within a domain: grouping by shard keeps it
        groups.setdefault((s["domain"], shard_of[s["image_id"]]), ([], []))[1].append(s)
    for g in drawn.gallery:
        groups[(g["domain"], shard_of[g["image_id"]])][0].append(g)
    for (_, index), (gallery, sampling) in sorted(groups.items()):
        if gallery:
            shard = accepted.read_shard(index, ["image_id", "image_bytes"])
            data = dict(zip(shard.column("image_id").to_pylist(), shard.column("image_bytes").to_pylist(),
                            strict=True))  # one pool shard's bytes
            gallery = [{**g, "image_bytes": data[g["image_id"]]} for g in gallery]
        yield {"gallery": pa.Table.from_pylist(gallery, schema=GALLERY),
               "sampling": pa.Table.from_pylist(sampling, schema=SAMPLING)}
    if not groups:
        yield {"gallery": GALLERY.empty_table(), "sampling": SAMPLING.empty_table()}


# -- MECF -----------------------------------------------------------------------------------------

def expert_caches(run: StageRun) -> list[EmbeddingCache]:
    """One embedding cache per configured expert's image side (under the output's ``cache/``, as the
    image embeddings; keyed by the expert's lineage with its parts): MECF and the evaluation share
    the gallery's vectors, and a re-evaluation after a label import encodes nothing."""
    registry = run.registry()
    return [EmbeddingCache(run.ctx.base, ExpertImages(registry.expert(spec), registry.lineage(spec)))
            for spec in run.models.experts]


class Mecf(Stage):
    """Every expert retrieves its top-K per query within the query's domain; keep the union (Eq. 1)."""

    name = "mecf"
    # 5: exact scores the same on any CPU (rde.common.topk.inner_products); 6: the attribute expert's
    # motion and direction slots compared with the gallery's video tracks
    version = "6"
    reads = ("queries", "gallery", "accepted")
    writes = (Write("candidates", "candidates", CANDIDATES),)
    config = ("retrieval", "track_facts")
    resources = Resources(device="gpu", hold_slot=False)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"experts": [run.registry().lineage(s) for s in run.models.experts]})

    def run(self, run: StageRun) -> Work:
        retrieval = run.section("retrieval")
        registry = run.registry()
        queries = run.input("queries").rows(["query_id", "domain", "text"])
        gallery_artifact = run.input("gallery")
        gallery = gallery_artifact.rows(["image_id", "domain"])  # no bytes: the caches stream them per shard
        caches = expert_caches(run)
        tracks: dict[str, dict[str, list[str]]] | None = None  # read once, for an expert with track slots
        rows = []
        per_expert_counts: dict[str, int] = {}
        for domain in sorted({q["domain"] for q in queries}):
            q_idx = [i for i, q in enumerate(queries) if q["domain"] == domain]
            g_idx = [i for i, g in enumerate(gallery) if g["domain"] == domain]
            if not q_idx or not g_idx:
                continue
            per_expert = {}
            for spec, cache in zip(run.models.experts, caches, strict=True):
                expert = registry.expert(spec)
                name = f"{spec.backend}:{spec.model_id}"
                texts = [queries[i]["text"] for i in q_idx]
                qv = expert.encode_text(texts)
                kept, gv = cache.embed_artifact(gallery_artifact, ["image_id", "domain"],
                                                keep=lambda r, domain=domain: r["domain"] == domain)
                if getattr(expert, "track_slots", False):
                    if tracks is None:
                        tracks = track_facts(run.input("accepted"), [g["image_id"] for g in gallery],
                                             run.section("track_facts"))
                    qv, gv = fuse_track_slots(qv, gv, texts, [tracks.get(r["image_id"], {}) for r in kept])
                per_expert[name] = topk(qv, gv, retrieval.top_k, retrieval.index_above, retrieval.ann)
                per_expert_counts[name] = per_expert_counts.get(name, 0) + int(per_expert[name][0].size)
            for cand in mecf.union_candidates(per_expert):
                names = sorted(cand.ranks)
                rows.append({"query_id": queries[q_idx[cand.query]]["query_id"],
                             "image_id": gallery[g_idx[cand.item]]["image_id"], "domain": domain,
                             "experts": names, "ranks": [cand.ranks[n] for n in names],
                             "scores": [cand.scores[n] for n in names], "best_rank": min(cand.ranks.values())})
        stats = {"input_rows": len(queries), "accepted": len(rows), "per_expert_candidates": per_expert_counts,
                 "union_candidates": len(rows), "embedded": sum(c.embedded for c in caches)}
        return Work.one({"candidates": pa.Table.from_pylist(rows, schema=CANDIDATES)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        table = [{"expert": k, "candidates": v} for k, v in stats.get("per_expert_candidates", {}).items()]
        table.append({"expert": "union (Eq. 1)", "candidates": stats.get("union_candidates", 0)})
        return Report(tables=[("mecf-union", table, "MECF: top-K candidates per expert and their union")],
                      log=f"mecf: {table}")


# -- export + evaluation --------------------------------------------------------------------------

class Export(Stage):
    """queries / gallery / qrels artifacts, a dataset card and the review files. Candidates people
    decided on (the ``decisions`` artifact, filled by ``rde labels import``) become verified qrels;
    the others stay ``verified = false`` (the "unverified" benchmark)."""

    name = "export"
    # 4: qrels say which tool each decision came from; 5: the review site and Label Studio grid tasks
    version = "5"
    reads = ("queries", "gallery", "candidates")
    optional_reads = ("decisions",)
    config = ("review",)
    writes = (Write("queries", "queries", QUERIES, folder="benchmark/queries"),
              Write("gallery", "gallery", GALLERY, folder="benchmark/gallery"),
              Write("qrels", "qrels", QRELS, folder="benchmark/qrels"))
    main = "qrels"
    # every candidate becomes one qrels row: input is the candidates artifact's row count (its
    # manifest), accepted the qrels rows written
    balance = True

    def run(self, run: StageRun) -> Work:
        decisions = run.input("decisions")
        queries = pa.concat_tables([t for _, t in run.input("queries").iter_shards()])
        gallery = run.input("gallery")
        candidates = run.input("candidates")
        # every column the decisions have (one imported before decisions kept their tool has no 'tool')
        made = {(d["query_id"], d["image_id"]): d for d in decisions.rows()} if decisions.is_complete() else {}
        qrels = pa.Table.from_pylist(qrel_rows(candidates.rows(["query_id", "image_id"]), made), schema=QRELS)
        verified = sum(qrels.column("verified").to_pylist())
        stats = {"input_rows": candidates.count_rows(), "accepted": qrels.num_rows, "verified": verified,
                 "decisions_not_candidates": len(made) - verified}
        first = {"queries": queries, "qrels": qrels}

        def shards() -> Iterator[dict[str, pa.Table]]:
            """The gallery copied one shard at a time; queries and qrels in the first shard."""
            for index, table in gallery.iter_shards():
                yield {"gallery": table, **(first if index == 0 else
                                            {"queries": QUERIES.empty_table(), "qrels": QRELS.empty_table()})}
            if not gallery.manifest().shards:
                yield {"gallery": GALLERY.empty_table(), **first}

        return Work(shards(), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        """The dataset card (also written next to the benchmark) and, on a local disk, the review files."""
        bench = run.output_url("benchmark")
        card = dataset_card(run.ctx, bench)
        fs_path = Path(bench)
        if "://" not in bench:
            fs_path.mkdir(parents=True, exist_ok=True)
            (fs_path / "README.md").write_text(configs_header(BENCHMARK_TABLES) + card, encoding="utf-8")
            if not result.skipped or not (fs_path / "review" / "index.html").exists():
                write_review_files(run.ctx, run.section("review"), run.input("candidates"), run.input("queries").url,
                                   run.input("gallery").url, run.input("decisions"), fs_path / "review")
        return Report(markdown=[("dataset-card", card_folder_note(bench) + card, "Benchmark dataset card")])


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


def write_review_files(ctx: RunContext, spec: ReviewSpec, candidates: Artifact, queries_url: str, gallery_url: str,
                       decisions: Artifact, folder: Path) -> None:
    """The review site and the Label Studio tasks (``review_site.build_review``), streamed over the
    candidates and the gallery in record batches; decisions already imported show as decided."""
    files = ReviewFiles(folder, f"{ctx.flow_name} / {ctx.profile.name}", candidates.manifest().stage_key,
                        spec.page_size, spec.thumbnail_height, spec.label_studio_images)
    queries = {q["query_id"]: q for q in Artifact(queries_url).rows(["query_id", "domain", "text"])}
    columns = ["query_id", "image_id", "experts", "best_rank"]
    imported = {(d["query_id"], d["image_id"]): d for d in decisions.rows()} if decisions.is_complete() else {}
    counts = build_review(files, (r for b in candidates.iter_batches(columns) for r in b.to_pylist()), queries,
                          (r for b in Artifact(gallery_url).iter_batches(["image_id", "image_bytes"], 256)
                           for r in b.to_pylist()), imported)
    log(f"review: {counts['candidates']} candidates of {counts['queries']} queries → {folder / 'index.html'}; "
        f"{counts['label_studio_tasks']} Label Studio tasks → {folder / 'label_studio_tasks.json'}")


BENCHMARK_TABLES = ("queries", "gallery", "qrels")  # the benchmark folder's tables, each a config of its card


def dataset_card(ctx: RunContext, bench: str) -> str:
    queries = Artifact(f"{bench}/queries").to_pandas(["query_id", "domain"])
    gallery = Artifact(f"{bench}/gallery").to_pandas(["image_id", "domain"])
    qrels = Artifact(f"{bench}/qrels").to_pandas()
    per_query = qrels.groupby("query_id").size()
    low, mid, high = (int(per_query.min()), float(per_query.median()), int(per_query.max())) if len(per_query) \
        else (0, 0.0, 0)
    lines = [f"# SecMM-style benchmark ({ctx.profile.name} profile)", "",
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


class Evaluate(Stage):
    """mAP@10/20/30 and R@1/5/10 per domain for every configured expert, on the built benchmark's
    verified qrels (none until people review the candidates: reported as pending) and on the
    profile's hand-labelled check sets."""

    name = "evaluate"
    # 4: rankings from scores that are the same on any CPU; 5: the attribute expert's track slots
    version = "5"
    reads = ("benchmark/qrels", "benchmark/queries", "benchmark/gallery", "accepted")
    writes = (Write("evaluation", "evaluation", EVALUATION),)
    config = ("evaluation", "track_facts")
    resources = Resources(device="gpu", hold_slot=False)

    def lineage(self, run: StageRun) -> Lineage:
        check_files = [resolve_location(f) for f in run.section("evaluation").check_sets]
        run.prepared["check_files"] = check_files
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
            qv, gv = expert.encode_text(texts), gallery_vectors(cache)
            if getattr(expert, "track_slots", False):
                qv, gv = fuse_track_slots(qv, gv, texts, gallery_facts)
            res = evaluate_expert(qv, [q["domain"] for q in queries], [q["query_id"] for q in queries], gv,
                                  [g["domain"] for g in gallery], [g["image_id"] for g in gallery], qrels)
            for domain, metrics in res.items():
                n = int(metrics.pop("queries"))
                rows += [{"benchmark": bench, "labels": labels, "expert": f"{spec.backend}:{spec.model_id}",
                          "domain": domain, "metric": m, "value": v, "queries": n} for m, v in metrics.items()]
        return rows

    def run(self, run: StageRun) -> Work:
        evaluation = run.section("evaluation")
        rows: list[dict[str, Any]] = []
        qrels_rows = run.input("benchmark/qrels").rows(["query_id", "image_id", "relevant", "verified"])
        verified: dict[str, set[str]] = {}
        for r in qrels_rows:
            if r["verified"] and r["relevant"]:
                verified.setdefault(r["query_id"], set()).add(r["image_id"])
        pending = sum(not r["verified"] for r in qrels_rows)
        caches = expert_caches(run)
        if verified:
            queries = run.input("benchmark/queries").rows(["query_id", "domain", "text"])
            bench_gallery = run.input("benchmark/gallery")
            gallery = bench_gallery.rows(["image_id", "domain"])  # no bytes: the caches stream them per shard
            tracks = track_facts(run.input("accepted"), [g["image_id"] for g in gallery], run.section("track_facts"))
            rows += self._score(run, caches, f"{run.ctx.flow_name}/{run.profile_name}", "verified", queries, gallery,
                                lambda cache: cache.embed_artifact(bench_gallery, ["image_id"])[1], verified,
                                [tracks.get(g["image_id"], {}) for g in gallery])
        for path in run.prepared["check_files"]:
            check = load_check_set(resolve_location(evaluation.check_set_pool), Path(path))
            data = load_check_yaml(Path(path))
            queries = [{"query_id": q["id"], "domain": q["domain"], "text": q["text"]} for q in data["queries"]]
            gallery = [{"image_id": str(i), "domain": d} for i, d in enumerate(check.gallery_domains)]
            qrels = {q["query_id"]: {str(i) for i in check.relevant_positions(n)} for n, q in enumerate(queries)}
            assert check.gallery_ids is not None  # load_check_set hashes every crop it reads
            rows += self._score(run, caches, f"check-set:{data.get('name', Path(path).stem)}", "verified", queries,
                                gallery, lambda cache, check=check: cache.embed(
                                    check.gallery_ids, lambda pos: [check.gallery_images[p] for p in pos]), qrels,
                                gallery_track_facts(check, run.section("track_facts")))
        return Work.one({"evaluation": pa.Table.from_pylist(rows, schema=EVALUATION)},
                        {"input_rows": len(qrels_rows), "accepted": len(rows), "pending_review": pending,
                         "verified_queries": len(verified), "embedded": sum(c.embedded for c in caches)})

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
        return Report(tables=[("evaluation", wide or [{"benchmark": "-"}],
                               "Zero-shot retrieval per expert and domain (verified labels only)")],
                      log="\n".join(lines))


SECMM_STAGES: tuple[Stage, ...] = (CaptionPool(), CaptionStats(), Dap(), Cgds(), Mecf(), Export(), Evaluate())
