"""build-largefine stages after denoise: select + hard-negative neighbours → base and intermediate
tiers (per shard, ``gpu``-tagged) → template gallery → advanced tier (per shard) → export of the
LargeFine-style caption shards with a dataset card (GTR+ Table 1 statistics)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from models.backends.registry import BUNDLED_LLM, ModelRegistry, spec_lineage
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde import caption_stats
from rde.embedding_cache import EmbeddingCache
from rde.hard_negatives import draw_seed, hard_negative_neighbours
from rde.image_decoding import decode_rgb
from rde.template_gallery import Gallery, Template, build_gallery
from rde.tiered_captions import TIERS, TierCaptioner, TierImage, TierOutputs, assign_generator
from storage import Artifact, content_key
from storage.schemas import NEIGHBOURS, QA_PAIRS, TEMPLATES, TEXT_REJECTS, TIER_CAPTIONS
from tasks import sharded
from tasks.context import RunContext
from tasks.reporting import log, publish_markdown, publish_table, stage_table

# Each stage's own version: bump one when that stage changes what it writes (it and its readers rerun).
VERSIONS = {"hard-negatives": "2", "qa-tiers": "2", "template-gallery": "2", "adv-tier": "2", "export-largefine": "2"}
GALLERY_PROMPT = "gtr_template_gallery"


def _fingerprint(url: str) -> str:
    return Artifact(url).manifest().fingerprint


def _shard_count(url: str) -> int:
    return len(Artifact(url).manifest().shards)


# -- select + neighbours ----------------------------------------------------------------------------

@task(name="hard-negatives", cache_policy=NO_CACHE)
def neighbours_task(ctx: RunContext, accepted_url: str) -> sharded.StageResult:
    """Choose the images to caption (profile domains, optional seeded cap), embed them with the
    profile's image embedder (cached by content hash), find each one's top-k neighbours and draw its
    hard negative (GTR+ Eq. 1), assign a generator; written in shards of ``largefine.shard_size``."""
    p, lf = ctx.profile, ctx.profile.largefine
    registry = ModelRegistry(p.models)
    embedder_spec = p.models.image_embedder
    key = content_key(stage="hard-negatives", version=VERSIONS["hard-negatives"], accepted=_fingerprint(accepted_url),
                      embedder=spec_lineage(embedder_spec), domains=lf.domains, max_images=lf.max_images,
                      k=lf.neighbours_k, seed=lf.seed, shard_size=lf.shard_size,
                      generators=[g.model_dump(mode="json") for g in p.models.generators])
    outs = [sharded.Output("neighbours", ctx.artifact_url("neighbours"), "neighbours", NEIGHBOURS),
            sharded.Output("rejects", ctx.artifact_url("select_rejects"), "text_rejects", TEXT_REJECTS)]
    if sharded.all_complete(outs, key):
        log("hard-negatives: skipped, complete for the same pool and settings")
        return sharded.skipped_result("hard-negatives", outs, "neighbours")
    if not p.models.generators:
        raise ValueError("build-largefine: the profile names no models.generators to caption with")
    with sharded.Timer() as timer:
        sharded.begin(outs, key)
        accepted = Artifact(accepted_url)
        rows = [dict(r, accepted_shard=index) for index, table in
                accepted.iter_shards(["image_id", "source", "domain", "identity"]) for r in table.to_pylist()]
        chosen, rejects = _select(rows, lf.domains, lf.max_images, lf.seed)
        cache = EmbeddingCache(ctx.root, registry.image_embedder())

        def load(positions: list[int]) -> list[np.ndarray]:
            wanted: dict[int, set[str]] = defaultdict(set)
            for i in positions:
                wanted[chosen[i]["accepted_shard"]].add(chosen[i]["image_id"])
            return _images(accepted_url, wanted, [chosen[i]["image_id"] for i in positions])

        vectors = cache.embed([r["image_id"] for r in chosen], load) if chosen else np.zeros((0, 1), np.float32)
        found = hard_negative_neighbours(vectors, [r["image_id"] for r in chosen], lf.neighbours_k, lf.seed,
                                         lf.neighbour_index_above)
        shard_of = {r["image_id"]: r["accepted_shard"] for r in chosen}
        n_gen = len(p.models.generators)
        out_rows = [{**{k: r[k] for k in ("image_id", "source", "domain", "identity", "accepted_shard")},
                     "neighbour_ids": nb.neighbour_ids, "neighbour_scores": nb.scores,
                     "hard_negative_id": nb.hard_negative_id,
                     "hard_negative_shard": shard_of.get(nb.hard_negative_id) if nb.hard_negative_id else None,
                     "generator_index": assign_generator(lf.seed, r["image_id"], n_gen),
                     "seed": draw_seed(lf.seed, r["image_id"])}
                    for r, nb in zip(chosen, found, strict=True)]
        table = pa.Table.from_pylist(out_rows, schema=NEIGHBOURS)
        n_shards = max(1, -(-len(out_rows) // lf.shard_size))
        reject_table = pa.Table.from_pylist(rejects, schema=TEXT_REJECTS)
        shards = [sharded.write_shards(outs, key, i, {
            "neighbours": table.slice(i * lf.shard_size, lf.shard_size),
            "rejects": reject_table if i == 0 else TEXT_REJECTS.empty_table()}) for i in range(n_shards)]
        stats = {"input_rows": len(rows), "accepted": len(chosen),
                 "rejected": dict(Counter(r["reason"] for r in rejects)), "embedded": cache.embedded,
                 "without_hard_negative": sum(nb.hard_negative_id is None for nb in found)}
        stats["balanced"] = sharded.check_balance("hard-negatives", stats)
        sharded.finalize(outs, key, shards, ctx, upstream=[accepted], config={"largefine": lf.model_dump()},
                         models={"image_embedder": cache.identity}, stats=stats)
    log(f"hard-negatives: {len(chosen)}/{len(rows)} images chosen, top-{lf.neighbours_k} neighbours, "
        f"{cache.embedded} embedded (rest cached), {n_shards} shards, {timer.seconds:.1f}s")
    return sharded.StageResult("hard-negatives", False, {o.name: o.url for o in outs}, len(rows), len(chosen),
                               stats["rejected"], n_shards, 0, timer.seconds, balanced=True)


def _select(rows: list[dict[str, Any]], domains: list[str], max_images: int | None, seed: int
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows in the profile's domains, capped at ``max_images`` by a seeded, order-independent draw;
    every other row becomes a rejected row (``out_of_domain`` / ``not_sampled``)."""
    rejects = [{"source_id": r["image_id"], "domain": r["domain"], "stage": "select", "reason": "out_of_domain",
                "text": None, "detail": f"domain {r['domain']!r} not in largefine.domains {domains}"}
               for r in rows if r["domain"] not in domains]
    kept = [r for r in rows if r["domain"] in domains]
    if max_images is not None and len(kept) > max_images:
        ranked = sorted(kept, key=lambda r: draw_seed(seed, r["image_id"] + "#sample"))
        chosen_ids = {r["image_id"] for r in ranked[:max_images]}
        rejects += [{"source_id": r["image_id"], "domain": r["domain"], "stage": "select", "reason": "not_sampled",
                     "text": None, "detail": f"largefine.max_images = {max_images}"}
                    for r in kept if r["image_id"] not in chosen_ids]
        kept = [r for r in kept if r["image_id"] in chosen_ids]
    return kept, rejects


def _images(accepted_url: str, wanted: dict[int, set[str]], order: list[str]) -> list[np.ndarray]:
    """Decoded images of ``order`` (ids), reading only the accepted shards that hold them."""
    found: dict[str, np.ndarray] = {}
    accepted = Artifact(accepted_url)
    for shard, ids in wanted.items():
        table = accepted.read_shard(shard, ["image_id", "image_bytes"])
        for image_id, data in zip(table.column("image_id").to_pylist(), table.column("image_bytes").to_pylist(),
                                  strict=True):
            if image_id in ids and image_id not in found:
                found[image_id] = decode_rgb(data)
    return [found[i] for i in order]


def _tier_images(accepted_url: str, rows: list[dict[str, Any]], with_negatives: bool) -> list[TierImage]:
    wanted: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        wanted[r["accepted_shard"]].add(r["image_id"])
        if with_negatives and r["hard_negative_id"]:
            wanted[r["hard_negative_shard"]].add(r["hard_negative_id"])
    ids = sorted({i for s in wanted.values() for i in s})
    images = dict(zip(ids, _images(accepted_url, wanted, ids), strict=True))
    return [TierImage(r["image_id"], r["source"], r["domain"], images[r["image_id"]], r["generator_index"],
                      r["hard_negative_id"] if with_negatives else None,
                      images.get(r["hard_negative_id"]) if with_negatives and r["hard_negative_id"] else None)
            for r in rows]


def _tables(out: TierOutputs, images: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    return ({"captions": pa.Table.from_pylist(out.captions, schema=TIER_CAPTIONS),
             "qa": pa.Table.from_pylist(out.qa, schema=QA_PAIRS),
             "rejects": pa.Table.from_pylist(out.rejects, schema=TEXT_REJECTS)}, out.stats(images))


def _generator_lineage(ctx: RunContext) -> dict[str, Any]:
    return {"generators": [spec_lineage(g) for g in ctx.profile.models.generators]}


# -- base + intermediate tiers ----------------------------------------------------------------------

def run_qa_tiers(ctx: RunContext, accepted_url: str, neighbours_url: str) -> sharded.StageResult:
    """Base and intermediate tiers, one ``gpu``-tagged task per neighbours shard."""
    p, lf = ctx.profile, ctx.profile.largefine
    prompt = load_prompt(lf.tier_prompt)
    key = content_key(stage="qa-tiers", version=VERSIONS["qa-tiers"], neighbours=_fingerprint(neighbours_url),
                      prompt=prompt.identity, generation=_generation_settings(ctx), **_generator_lineage(ctx))
    outs = [sharded.Output("captions", ctx.artifact_url("tier12_captions"), "tier_captions", TIER_CAPTIONS),
            sharded.Output("qa", ctx.artifact_url("qa_pairs"), "qa_pairs", QA_PAIRS),
            sharded.Output("rejects", ctx.artifact_url("tier12_rejects"), "text_rejects", TEXT_REJECTS)]

    def compute(index: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
        rows = Artifact(neighbours_url).read_shard(index).to_pylist()
        captioner = TierCaptioner(ModelRegistry(p.models).generators(), prompt, lf)
        items = _tier_images(accepted_url, rows, with_negatives=True)
        out = TierOutputs()
        captioner.qa_tier(items, "base", out)
        captioner.qa_tier(items, "inter", out)
        return _tables(out, len(items))

    return sharded.run_sharded(ctx, "qa-tiers", outs, key, _shard_count(neighbours_url), compute,
                               sharded.count_accepted_rejected("captions", "rejects"), balance=True,
                               tags=[p.prefect.gpu_concurrency_limit],
                               concurrency_limit=p.prefect.gpu_concurrency_limit,
                               upstream=[Artifact(neighbours_url)],
                               models=_generator_lineage(ctx), prompt_versions={lf.tier_prompt: prompt.identity})


def _generation_settings(ctx: RunContext) -> dict[str, Any]:
    lf = ctx.profile.largefine
    return lf.model_dump(include={"temperature", "qa_max_tokens", "summary_max_tokens", "min_qa_pairs", "min_words",
                                  "max_words", "max_repeated_sentence_share", "drop_repeated_sentences", "boilerplate",
                                  "negative_mentions", "seed", "tier_prompt"})


# -- template gallery -------------------------------------------------------------------------------

@task(name="template-gallery", cache_policy=NO_CACHE)
def gallery_task(ctx: RunContext, tier12_url: str) -> sharded.StageResult:
    """The advanced tier's template gallery: seeds + extract-and-expand over sampled tier-1/2
    captions with the profile's text generator; rejected candidates kept with reasons."""
    p, spec = ctx.profile, ctx.profile.largefine.templates
    prompt = load_prompt(GALLERY_PROMPT)
    gen_spec = p.models.template_generator or ModelSpec(**BUNDLED_LLM)
    key = content_key(stage="template-gallery", version=VERSIONS["template-gallery"], captions=_fingerprint(tier12_url),
                      prompt=prompt.identity, generator=spec_lineage(gen_spec), spec=spec.model_dump())
    outs = [sharded.Output("templates", ctx.artifact_url("template_gallery"), "templates", TEMPLATES),
            sharded.Output("rejects", ctx.artifact_url("template_rejects"), "text_rejects", TEXT_REJECTS)]

    def compute() -> tuple[dict[str, pa.Table], dict[str, Any]]:
        texts = [r["text"] for r in Artifact(tier12_url).rows(["text"])]
        rng = np.random.default_rng(spec.seed)
        sample = [texts[i] for i in sorted(rng.choice(len(texts), size=min(spec.sample_captions, len(texts)),
                                                      replace=False))] if texts else []
        generator = ModelRegistry(p.models).generator(gen_spec)
        gallery = build_gallery(generator.generate, sample, prompt, captions_per_request=spec.captions_per_request,
                                rounds=spec.rounds, max_templates=spec.max_templates, min_words=spec.min_words,
                                max_words=spec.max_words, max_tokens=spec.max_tokens, temperature=spec.temperature,
                                seed=spec.seed)
        rows = [{"template_id": t.template_id, "text": t.text, "slots": list(t.slots), "origin": t.origin,
                 "round": t.round} for t in gallery.templates]
        rejects = [{"source_id": f"round-{r.round}", "domain": "template", "stage": f"template-{r.origin}",
                    "reason": r.reason, "text": r.text, "detail": r.detail} for r in gallery.rejected]
        stats = {"input_rows": gallery.candidates, "accepted": len(rows),
                 "rejected": dict(Counter(r["reason"] for r in rejects)), "gallery_version": gallery.version,
                 "sampled_captions": len(sample), "by_origin": dict(Counter(t.origin for t in gallery.templates))}
        return {"templates": pa.Table.from_pylist(rows, schema=TEMPLATES),
                "rejects": pa.Table.from_pylist(rejects, schema=TEXT_REJECTS)}, stats

    result = sharded.run_single(ctx, "template-gallery", outs, key, compute, balance=True,
                                upstream=[Artifact(tier12_url)],
                                models={"template_generator": spec_lineage(gen_spec)},
                                prompt_versions={GALLERY_PROMPT: prompt.identity})
    gallery = load_gallery(outs[0].url)
    log(f"template-gallery: {'skipped, ' if result.skipped else ''}{len(gallery.templates)} templates "
        f"({gallery.version}), {sum(result.rejected.values())} candidates rejected")
    return result


def load_gallery(url: str) -> Gallery:
    rows = Artifact(url).rows()
    return Gallery([Template(r["template_id"], r["text"], tuple(r["slots"]), r["origin"], r["round"])
                    for r in rows], [])


# -- advanced tier ----------------------------------------------------------------------------------

def run_advanced_tier(ctx: RunContext, accepted_url: str, neighbours_url: str, tier12_url: str,
                      gallery_url: str) -> sharded.StageResult:
    """T_adv per image from a drawn template and its T_base + T_inter; one task per shard."""
    p, lf = ctx.profile, ctx.profile.largefine
    prompt = load_prompt(lf.tier_prompt)
    key = content_key(stage="adv-tier", version=VERSIONS["adv-tier"], neighbours=_fingerprint(neighbours_url),
                      tier12=_fingerprint(tier12_url), gallery=_fingerprint(gallery_url), prompt=prompt.identity,
                      generation=_generation_settings(ctx), **_generator_lineage(ctx))
    outs = [sharded.Output("captions", ctx.artifact_url("adv_captions"), "tier_captions", TIER_CAPTIONS),
            sharded.Output("rejects", ctx.artifact_url("adv_rejects"), "text_rejects", TEXT_REJECTS)]

    def compute(index: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
        rows = Artifact(neighbours_url).read_shard(index).to_pylist()
        earlier = Artifact(tier12_url).read_shard(index, ["image_id", "tier", "text"]).to_pylist()
        texts = {tier: {r["image_id"]: r["text"] for r in earlier if r["tier"] == tier} for tier in ("base", "inter")}
        captioner = TierCaptioner(ModelRegistry(p.models).generators(), prompt, lf)
        items = _tier_images(accepted_url, rows, with_negatives=False)
        for item, row in zip(items, rows, strict=True):
            item.negative_id = row["hard_negative_id"]  # recorded on the T_adv row; the image is not needed
        out = TierOutputs()
        captioner.advanced_tier(items, texts["base"], texts["inter"], load_gallery(gallery_url), out)
        tables, stats = _tables(out, len(items))
        return {"captions": tables["captions"], "rejects": tables["rejects"]}, stats

    return sharded.run_sharded(ctx, "adv-tier", outs, key, _shard_count(neighbours_url), compute,
                               sharded.count_accepted_rejected("captions", "rejects"), balance=True,
                               tags=[p.prefect.gpu_concurrency_limit],
                               concurrency_limit=p.prefect.gpu_concurrency_limit,
                               upstream=[Artifact(neighbours_url), Artifact(tier12_url), Artifact(gallery_url)],
                               models=_generator_lineage(ctx), prompt_versions={lf.tier_prompt: prompt.identity})


# -- export + card ----------------------------------------------------------------------------------

@task(name="export-largefine", cache_policy=NO_CACHE)
def export_task(ctx: RunContext, neighbours_url: str, tier12_url: str, tier12_rejects_url: str, adv_url: str,
                adv_rejects_url: str) -> sharded.StageResult:
    """The LargeFine-style shards (one row per image and tier, aligned with the captioning
    shards) and all caption rejects in one artifact; then the dataset card. Its input is counted
    from the chosen images (``neighbours``): each ends as one caption or one reject per tier."""
    key = content_key(stage="export-largefine", version=VERSIONS["export-largefine"],
                      parts=[_fingerprint(u) for u in (tier12_url, tier12_rejects_url, adv_url, adv_rejects_url)])
    outs = [sharded.Output("captions", ctx.artifact_url("largefine"), "tier_captions", TIER_CAPTIONS),
            sharded.Output("rejects", ctx.artifact_url("caption_rejects"), "text_rejects", TEXT_REJECTS)]
    order = {tier: i for i, tier in enumerate(TIERS)}

    def compute(index: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
        caps = pa.concat_tables([Artifact(tier12_url).read_shard(index), Artifact(adv_url).read_shard(index)])
        rows = sorted(caps.to_pylist(), key=lambda r: (r["image_id"], order[r["tier"]]))
        rejects = pa.concat_tables([Artifact(tier12_rejects_url).read_shard(index),
                                    Artifact(adv_rejects_url).read_shard(index)])
        tables = {"captions": pa.Table.from_pylist(rows, schema=TIER_CAPTIONS), "rejects": rejects}
        images = Artifact(neighbours_url).read_shard(index, ["image_id"]).num_rows
        return tables, {**sharded.count_accepted_rejected("captions", "rejects")(tables),
                        "input_rows": images * len(TIERS), "images": images}

    result = sharded.run_sharded(ctx, "export-largefine", outs, key, _shard_count(tier12_url), compute,
                                 sharded.count_accepted_rejected("captions", "rejects"), balance=True,
                                 upstream=[Artifact(u) for u in (neighbours_url, tier12_url, tier12_rejects_url,
                                                                 adv_url, adv_rejects_url)])
    card, stats = dataset_card(ctx)
    if "://" not in ctx.root:
        write_card(Path(ctx.root), card, stats)
    publish_markdown(f"{ctx.flow_name}-dataset-card", card, "LargeFine-style dataset card (GTR+ Table 1 statistics)")
    return replace(result, rejects_from_upstream=True)  # the tier stages rejected them; counted there


CARD_FILES = ("README.md", "card.json")  # beside the artifact folders, never inside one
# The card's Hugging Face header: `load_dataset(run_folder[, "caption_rejects"])` reads these folders.
CARD_CONFIGS = ("---\nconfigs:\n- config_name: default\n  data_files: largefine/*.parquet\n"
                "- config_name: caption_rejects\n  data_files: caption_rejects/*.parquet\n---\n\n")


def write_card(run_folder: Path, card: str, stats: dict[str, Any]) -> None:
    """The dataset card at the run folder's top (a Hugging Face dataset layout: card at the root,
    Parquet in subfolders), so every artifact folder holds only shards and ``_manifest.json`` and
    opens with pandas, pyarrow and ``datasets``; a card left inside ``largefine/`` by an older
    version is removed."""
    (run_folder / CARD_FILES[0]).write_text(CARD_CONFIGS + card, encoding="utf-8")
    (run_folder / CARD_FILES[1]).write_text(json.dumps(stats, indent=1), encoding="utf-8")
    for name in CARD_FILES:
        (run_folder / "largefine" / name).unlink(missing_ok=True)


def corpus_statistics(texts_by_tier: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """GTR+ Table 1 columns per tier and overall (real POS tagger and noun chunker)."""
    nlp = caption_stats.load_tagger()
    out = {tier: caption_stats.text_statistics(texts, nlp) for tier, texts in texts_by_tier.items() if texts}
    out["all"] = caption_stats.text_statistics([t for texts in texts_by_tier.values() for t in texts], nlp)
    return out


def dataset_card(ctx: RunContext) -> tuple[str, dict[str, Any]]:
    """Markdown card and its numbers: Table 1 statistics, multi-granularity, retention per stage,
    per-source counts and generator throughput."""
    captions = Artifact(ctx.artifact_url("largefine")).rows(["image_id", "source", "tier", "text", "generator"])
    by_tier: dict[str, list[str]] = {tier: [r["text"] for r in captions if r["tier"] == tier] for tier in TIERS}
    table1 = corpus_statistics(by_tier)
    multi = sum(bool(v) for v in by_tier.values()) > 1
    manifests = {name: Artifact(ctx.artifact_url(name)).manifest().stats for name in
                 ("images", "accepted", "neighbours", "tier12_captions", "adv_captions", "largefine")}
    per_source: dict[str, Counter[str]] = defaultdict(Counter)
    for _, t in Artifact(ctx.artifact_url("images")).iter_shards(["source"]):
        for s in t.column("source").to_pylist():
            per_source[_source_name(s)]["ingested"] += 1
    for _, t in Artifact(ctx.artifact_url("accepted")).iter_shards(["source"]):
        for s in t.column("source").to_pylist():
            per_source[_source_name(s)]["denoised"] += 1
    for r in captions:
        per_source[_source_name(r["source"])]["texts"] += 1
    stats = {"table1": table1, "multi_granularity": multi, "stages": manifests,
             "per_source": {k: dict(v) for k, v in per_source.items()},
             "generators": dict(Counter(r["generator"] for r in captions))}
    lines = [f"# LargeFine-style person captions ({ctx.profile.name} profile)", "",
             "One row per (image, tier) in `largefine/`: `tier` is base (Q&A), inter (hard-negative comparison) or "
             "adv (stylized template); `text` is the cleaned training text, `raw_text` the generator's output and "
             "`cleaning` what was removed (hard-negative mentions, boilerplate, repeated sentences); `q_txt` is the "
             "mean token probability (GTR+ Eq. 8).", "",
             "```python", "import pandas as pd", "from datasets import load_dataset", "",
             f'captions = pd.read_parquet("{ctx.artifact_url("largefine")}")',
             f'ds = load_dataset("parquet", data_files="{ctx.artifact_url("largefine")}/*.parquet", split="train")',
             f'ds = load_dataset("{ctx.root}", split="train")  # this card\'s configs: default, caption_rejects',
             "```", "",
             "| texts | #texts | #words/text | #adj./text | #noun chunks/text |", "|---|---|---|---|---|"]
    for name, s in table1.items():
        lines.append(f"| {name} | {s['texts']} | {s['words_per_text']:.2f} | {s['adjectives_per_text']:.2f} | "
                     f"{s['noun_chunks_per_text']:.2f} |")
    lines += ["", f"Multi-granularity: {'yes' if multi else 'no'} (texts of {sum(bool(v) for v in by_tier.values())} "
              "tiers of detail).", "", "| source | ingested | after denoise | texts |", "|---|---|---|---|"]
    for source, c in sorted(per_source.items()):
        lines.append(f"| {source} | {c['ingested']} | {c['denoised']} | {c['texts']} |")
    lines += ["", "Rejected texts with reasons: `caption_rejects`; rejected images: `ingest_rejects`, "
              "`denoise_rejects`, `select_rejects`. Lineage: `_manifest.json` in each folder."]
    return "\n".join(lines), stats


def _source_name(source: str) -> str:
    """The dataset a row came from: ``pool:vtest.avi:crop:00012`` → ``pool:vtest.avi``; a path → its folder."""
    if source.startswith("pool:"):
        return ":".join(source.split(":")[:2])
    return str(Path(source).parent)


def throughput_rows(results: list[sharded.StageResult], ctx: RunContext) -> list[dict[str, Any]]:
    """Retention and throughput per captioning stage: images/s and tokens/s over the stage's wall
    time (shards run concurrently, so summed per-shard generator time would double count)."""
    rows = []
    for result in results:
        stats = Artifact(next(iter(result.artifacts.values()))).manifest().stats
        images, tokens = int(stats.get("images", 0)), int(stats.get("generated_tokens", 0))
        wall = result.seconds
        rows.append({"stage": result.stage, "input": result.input_rows, "accepted": result.accepted,
                     "retention": round(result.accepted / result.input_rows, 4) if result.input_rows else 0.0,
                     "images": images, "generator_calls": int(stats.get("generator_calls", 0)), "tokens": tokens,
                     "images_per_s": round(images / wall, 3) if wall and not result.skipped else None,
                     "tokens_per_s": round(tokens / wall, 1) if wall and not result.skipped else None,
                     "generator_seconds": float(stats.get("generator_seconds", 0.0)),
                     "stage_seconds": round(wall, 1), "skipped": result.skipped})
    return rows


def publish(result: sharded.StageResult, flow_name: str) -> None:
    publish_table(f"{flow_name}-{result.stage}", stage_table(result.stage, result.input_rows, result.accepted,
                                                             result.rejected, result.skipped),
                  f"{result.stage}: rows in, accepted, rejected by reason")
