"""build-largefine stages after denoise: select + hard-negative neighbours → base and intermediate
tiers (per shard, ``gpu``-tagged) → template gallery → advanced tier (per shard) → export of the
LargeFine-style caption shards with a dataset card (GTR+ Table 1 statistics)."""

from __future__ import annotations

import json
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from models.backends.registry import BUNDLED_IMAGE_EMBEDDER, BUNDLED_LLM, spec_lineage
from models.backends.track_facts import motion_facts
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde.common import caption_stats
from rde.common.dataset_cards import card_folder_note, configs_header, loading_snippet
from rde.common.image_decoding import decode_rgb
from rde.common.profiles import TrackFactsSpec
from rde.common.reasons import Reason, rejected_row
from rde.common.seeds import draw_seed
from rde.common.track_context import motion_options
from rde.largefine import webdataset_export
from rde.largefine.hard_negatives import chosen_vectors, hard_negative_neighbours_streamed
from rde.largefine.template_gallery import Gallery, Template, build_gallery
from rde.largefine.tiered_captions import TIERS, TierCaptioner, TierImage, TierOutputs, assign_generator
from storage import Artifact
from storage.filesystem import atomic_write_bytes, join, resolve
from storage.hashing import sha256_bytes
from storage.schemas import IMAGE_VECTORS, NEIGHBOURS, QA_PAIRS, REJECTS, TEMPLATES, TIER_CAPTIONS, WDS_INDEX
from tasks import sharded
from tasks.context import RunContext
from tasks.sharded import StageResult
from tasks.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write

GALLERY_PROMPT = "gtr_template_gallery"
# what the tier stages' texts depend on (the ``largefine`` fields in their keys)
GENERATION = (*(f"largefine.{name}" for name in (
    "temperature", "qa_max_tokens", "summary_max_tokens", "min_qa_pairs", "min_words", "max_words",
    "max_repeated_sentence_share", "drop_repeated_sentences", "boilerplate", "negative_mentions", "seed",
    "tier_prompt", "retries")), "track_facts")  # the images' video-track facts go into the requests; retries
# decide whether a call that failed for a transient reason ends as a caption or a reject


def _generator_lineage(run: StageRun) -> dict[str, Any]:
    registry = run.registry()
    return {"generators": [registry.lineage(g) for g in run.models.generators]}


# -- select + neighbours ----------------------------------------------------------------------------

class EmbedImages(Stage):
    """The profile's image embedder over every accepted image of ``largefine.domains``, one task per
    accepted shard. A GPU stage, so with ``prefect.fanout`` its shards run on the pool's workers:
    the parent keeps only the hard negatives' index and search. Rows of other domains are not this
    stage's input; each input row is embedded (an accepted image decodes)."""

    name = "embed-images"
    version = "1"
    reads = ("accepted",)
    writes = (Write("vectors", "image_vectors", IMAGE_VECTORS, folder="image_vectors"),)
    config = ("largefine.domains",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="models.image_embedder.batch_size")
    balance = True
    title = "Embed the images of largefine.domains for the hard-negative search"
    row_unit = "images"
    decode_batch: ClassVar[int] = 512  # images decoded and handed to the embedder at once (its own batches inside)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"image_embedder": spec_lineage(run.models.image_embedder or BUNDLED_IMAGE_EMBEDDER)})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("accepted").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        table = run.input("accepted").read_shard(index, ["image_id", "domain", "image_bytes"])
        domains = set(run.section("largefine").domains)
        keep = [i for i, d in enumerate(table.column("domain").to_pylist()) if d in domains]
        ids = table.column("image_id").take(keep).to_pylist() if keep else []
        embedder, column, vectors = run.registry().image_embedder(), table.column("image_bytes"), []
        for start in range(0, len(keep), self.decode_batch):  # decoded pixels: one batch at a time
            images = [decode_rgb(column[i].as_py()) for i in keep[start:start + self.decode_batch]]
            vectors += [v.astype(np.float32) for v in embedder.embed(images)]
        out = pa.table({"image_id": ids, "vector": pa.array(vectors, type=IMAGE_VECTORS.field("vector").type)},
                       schema=IMAGE_VECTORS)
        return Work.one({"vectors": out}, {"input_rows": len(keep), "accepted": len(keep), "rejected": {}})


class HardNegatives(Stage):
    """Choose the images to caption (profile domains, optional seeded cap), read their vectors
    (``embed-images``), find each one's top-k neighbours and draw its hard negative (GTR+ Eq. 1),
    assign a generator; written in shards of ``largefine.shard_size``."""

    name = "hard-negatives"
    # 3: exact scores the same on any CPU and for any query batch (rde.common.topk); 4: the vectors come
    # from embed-images (fanned out), not from the embedding cache
    version = "4"
    reads = ("accepted", "image_vectors")
    writes = (Write("neighbours", "neighbours", NEIGHBOURS),
              Write("rejects", "rejects", REJECTS, folder="select_rejects", rejects=True))
    config = ("largefine.domains", "largefine.max_images", "largefine.neighbours_k", "largefine.seed",
              "largefine.shard_size", "largefine.neighbour_index_above", "largefine.neighbour_ann")
    balance = True
    # images whose neighbours are searched together in the exact search (4096 × 1280 floats: 21 MB),
    # one pass over the vectors per batch; not a profile field, because a field in ``config`` enters
    # the stage key, which every shard records, and would rewrite identical neighbours
    query_batch: ClassVar[int] = 4096

    def lineage(self, run: StageRun) -> Lineage:
        if not run.models.generators:
            raise ValueError("build-largefine: the profile names no models.generators to caption with")
        # the generator count decides each image's generator (assign_generator)
        return Lineage(models={"generators": [g.model_dump(mode="json") for g in run.models.generators]})

    def run(self, run: StageRun) -> Work:
        """Select, then search the chosen rows' neighbours with their vectors left in ``image_vectors``
        (``hard_negative_neighbours_streamed``): a query batch and one pool shard of vectors in memory
        where the search is exact; all of them only above ``neighbour_index_above``, where the IVF
        index is built over the whole pool."""
        lf = run.section("largefine")
        accepted = run.input("accepted")
        rows = [dict(r, accepted_shard=index) for index, table in
                accepted.iter_shards(["image_id", "source", "domain", "identity"]) for r in table.to_pylist()]
        positions, rejects = _select(rows, lf.domains, lf.max_images, lf.seed)
        chosen = [rows[p] for p in positions]
        vectors = chosen_vectors(run.input("image_vectors"), rows, positions, set(lf.domains))
        found = hard_negative_neighbours_streamed(vectors.take, vectors.blocks, [r["image_id"] for r in chosen],
                                                  lf.neighbours_k, lf.seed, lf.neighbour_index_above,
                                                  lf.neighbour_ann, self.query_batch)
        shard_of = {r["image_id"]: r["accepted_shard"] for r in chosen}
        n_gen = len(run.models.generators)
        out_rows = [{**{k: r[k] for k in ("image_id", "source", "domain", "identity", "accepted_shard")},
                     "neighbour_ids": nb.neighbour_ids, "neighbour_scores": nb.scores,
                     "hard_negative_id": nb.hard_negative_id,
                     "hard_negative_shard": shard_of.get(nb.hard_negative_id) if nb.hard_negative_id else None,
                     "generator_index": assign_generator(lf.seed, r["image_id"], n_gen),
                     "seed": draw_seed(lf.seed, r["image_id"])}
                    for r, nb in zip(chosen, found, strict=True)]
        table = pa.Table.from_pylist(out_rows, schema=NEIGHBOURS)
        n_shards = max(1, -(-len(out_rows) // lf.shard_size))
        reject_table = pa.Table.from_pylist(rejects, schema=REJECTS)
        shards = [{"neighbours": table.slice(i * lf.shard_size, lf.shard_size),
                   "rejects": reject_table if i == 0 else REJECTS.empty_table()} for i in range(n_shards)]
        return Work(shards, {"input_rows": len(rows), "accepted": len(chosen),
                             "rejected": dict(Counter(r["reason"] for r in rejects)),
                             "without_hard_negative": sum(nb.hard_negative_id is None for nb in found)})

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(log=f"hard-negatives: top-{run.section('largefine').neighbours_k} neighbours of "
                          f"{result.accepted} images, {stats.get('without_hard_negative', 0)} without a hard negative")


def _select(rows: list[dict[str, Any]], domains: list[str], max_images: int | None, seed: int
            ) -> tuple[list[int], list[dict[str, Any]]]:
    """Positions in ``rows`` of the rows in the profile's domains, capped at ``max_images`` by a
    seeded, order-independent draw (by image id: a duplicate image is kept or dropped with its
    copies), in input order; every other row becomes a rejected row (``out_of_domain`` /
    ``not_sampled``). Positions, not ids, because one image may sit in two domains: only the row in
    a chosen domain is kept."""
    rejects = [rejected_row(r["image_id"], "select", Reason.OUT_OF_DOMAIN, kind="image", domain=r["domain"],
                            image_id=r["image_id"], source=r["source"],
                            detail=f"domain {r['domain']!r} not in largefine.domains {domains}")
               for r in rows if r["domain"] not in domains]
    kept = [p for p, r in enumerate(rows) if r["domain"] in domains]
    if max_images is not None and len(kept) > max_images:
        ranked = sorted(kept, key=lambda p: draw_seed(seed, rows[p]["image_id"] + "#sample"))
        chosen_ids = {rows[p]["image_id"] for p in ranked[:max_images]}
        rejects += [rejected_row(r["image_id"], "select", Reason.NOT_SAMPLED, kind="image", domain=r["domain"],
                                 image_id=r["image_id"], source=r["source"],
                                 detail=f"largefine.max_images = {max_images}")
                    for r in (rows[p] for p in kept) if r["image_id"] not in chosen_ids]
        kept = [p for p in kept if rows[p]["image_id"] in chosen_ids]
    return kept, rejects


def _accepted_rows(accepted_url: str, wanted: dict[int, set[str]], columns: list[str]) -> dict[str, dict[str, Any]]:
    """The accepted rows of the ``wanted`` ids (by accepted shard), ``columns`` of each, reading only the
    row groups that hold them (a caption shard's hard negatives are spread over the pool: whole shards
    would be read for one image each); a duplicate image once."""
    found: dict[str, dict[str, Any]] = {}
    accepted = Artifact(accepted_url)
    for shard, ids in wanted.items():
        for rec in accepted.read_matching(shard, "image_id", ids, ["image_id", *columns]).to_pylist():
            found.setdefault(rec["image_id"], rec)
    return found


def _tier_images(accepted_url: str, rows: list[dict[str, Any]], with_negatives: bool,
                 track: TrackFactsSpec) -> list[TierImage]:
    """The shard's images (and hard negatives), decoded, each with its video-track facts."""
    wanted: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        wanted[r["accepted_shard"]].add(r["image_id"])
        if with_negatives and r["hard_negative_id"]:
            wanted[r["hard_negative_shard"]].add(r["hard_negative_id"])
    found = _accepted_rows(accepted_url, wanted, ["image_bytes", "domain", "source_meta"])
    options = motion_options(track)
    images = {i: decode_rgb(rec["image_bytes"]) for i, rec in found.items()}
    facts = {i: motion_facts(rec["source_meta"], rec["domain"], options) for i, rec in found.items()}
    negative = [r["hard_negative_id"] if with_negatives and r["hard_negative_id"] else None for r in rows]
    return [TierImage(r["image_id"], r["source"], r["domain"], images[r["image_id"]], r["generator_index"],
                      neg, images.get(neg) if neg else None, facts[r["image_id"]], facts.get(neg, {}) if neg else {})
            for r, neg in zip(rows, negative, strict=True)]


def _tables(out: TierOutputs, images: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    return ({"captions": pa.Table.from_pylist(out.captions, schema=TIER_CAPTIONS),
             "qa": pa.Table.from_pylist(out.qa, schema=QA_PAIRS),
             "rejects": pa.Table.from_pylist(out.rejects, schema=REJECTS)},
            {**out.stats(images), **table1_counts(out.captions)})


def table1_counts(captions: list[dict[str, Any]]) -> dict[str, int]:
    """The shard's GTR+ Table 1 sums per tier (spaCy, where the shard is written: on the pool's
    worker), as flat ``table1.<tier>.<count>`` stats; the manifest sums them over the shards and the
    dataset card divides (``table1_from_stats``), so no process reads every caption for it."""
    out: dict[str, int] = {}
    for tier in TIERS:
        texts = [c["text"] for c in captions if c["tier"] == tier]
        if texts:
            counts = caption_stats.text_counts(texts, caption_stats.load_tagger())
            out.update({f"table1.{tier}.{name}": value for name, value in counts.items()})
    return out


def table1_from_stats(manifests: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Table 1 per tier and overall from the tier stages' summed ``table1.*`` stats; None when a
    manifest has none (written before the counts were kept: the card then counts the texts itself)."""
    if not all(any(k.startswith("table1.") for k in stats) for stats in manifests):
        return None
    sums = {tier: {name: sum(int(m.get(f"table1.{tier}.{name}", 0)) for m in manifests)
                   for name in caption_stats.TABLE1_COUNTS} for tier in TIERS}
    out = {tier: caption_stats.means_from_counts(c) for tier, c in sums.items() if c["texts"]}
    out["all"] = caption_stats.means_from_counts({name: sum(c[name] for c in sums.values())
                                                  for name in caption_stats.TABLE1_COUNTS})
    return out


# -- base + intermediate tiers ----------------------------------------------------------------------

class _TierStage(Stage):
    """A captioning tier: the profile's generators with the tier prompt, one task per neighbours
    shard holding a GPU slot; every (image, tier) asked for ends as a caption or a reject."""

    config = GENERATION
    resources = Resources(device="gpu")
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        prompt = load_prompt(run.section("largefine").tier_prompt)
        run.prepared["prompt"] = prompt
        return Lineage(models=_generator_lineage(run), prompts={prompt.name: prompt.identity})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("neighbours").manifest().shards)


class QaTiers(_TierStage):
    """Base and intermediate tiers, one task per neighbours shard holding a GPU slot."""

    name = "qa-tiers"
    version = "4"  # 3: each image's video-track facts go with it into the requests; 4: garbled texts rejected
    reads = ("neighbours", "accepted")
    writes = (Write("captions", "tier_captions", TIER_CAPTIONS, folder="tier12_captions"),
              Write("qa", "qa_pairs", QA_PAIRS, folder="qa_pairs"),
              Write("rejects", "rejects", REJECTS, folder="tier12_rejects", rejects=True))

    def process(self, run: StageRun, index: int) -> Work:
        rows = run.input("neighbours").read_shard(index).to_pylist()
        captioner = TierCaptioner(run.registry().generators(), run.prepared["prompt"], run.section("largefine"))
        items = _tier_images(run.input("accepted").url, rows, True, run.section("track_facts"))
        out = TierOutputs()
        captioner.qa_tier(items, "base", out)
        captioner.qa_tier(items, "inter", out)
        return Work.one(*_tables(out, len(items)))


# -- template gallery -------------------------------------------------------------------------------

class TemplateGallery(Stage):
    """The advanced tier's template gallery: seeds + extract-and-expand over sampled tier-1/2
    captions with the profile's text generator; rejected candidates kept with reasons."""

    name = "template-gallery"
    version = "3"  # 3: measurable_slots
    reads = ("tier12_captions",)
    writes = (Write("templates", "templates", TEMPLATES, folder="template_gallery"),
              Write("rejects", "rejects", REJECTS, folder="template_rejects", rejects=True))
    config = ("largefine.templates",)
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        prompt = load_prompt(GALLERY_PROMPT)
        gen_spec = run.models.template_generator or ModelSpec(**BUNDLED_LLM)
        run.prepared.update(prompt=prompt, gen_spec=gen_spec)
        return Lineage(models={"template_generator": run.registry().lineage(gen_spec)},
                       prompts={GALLERY_PROMPT: prompt.identity})

    def run(self, run: StageRun) -> Work:
        spec = run.section("largefine").templates
        texts = [r["text"] for r in run.input("tier12_captions").rows(["text"])]
        rng = np.random.default_rng(spec.seed)
        sample = [texts[i] for i in sorted(rng.choice(len(texts), size=min(spec.sample_captions, len(texts)),
                                                      replace=False))] if texts else []
        generator = run.registry().generator(run.prepared["gen_spec"])
        gallery = build_gallery(generator.generate, sample, run.prepared["prompt"],
                                captions_per_request=spec.captions_per_request, rounds=spec.rounds,
                                max_templates=spec.max_templates, min_words=spec.min_words, max_words=spec.max_words,
                                max_tokens=spec.max_tokens, temperature=spec.temperature, seed=spec.seed,
                                measurable_slots=spec.measurable_slots)
        rows = [{"template_id": t.template_id, "text": t.text, "slots": list(t.slots), "origin": t.origin,
                 "round": t.round} for t in gallery.templates]
        rejects = [rejected_row(f"round-{r.round}", f"template-{r.origin}", r.reason, kind="template",
                                domain="template", text=r.text, detail=r.detail) for r in gallery.rejected]
        return Work.one({"templates": pa.Table.from_pylist(rows, schema=TEMPLATES),
                         "rejects": pa.Table.from_pylist(rejects, schema=REJECTS)},
                        {"input_rows": gallery.candidates, "accepted": len(rows),
                         "rejected": dict(Counter(r["reason"] for r in rejects)), "gallery_version": gallery.version,
                         "sampled_captions": len(sample),
                         "by_origin": dict(Counter(t.origin for t in gallery.templates))})

    def report(self, run: StageRun, result: StageResult) -> Report:
        version = result.stats.get("gallery_version")
        return Report(log=f"template-gallery: {result.accepted} templates ({version}), "
                          f"{sum(result.rejected.values())} candidates rejected")


def load_gallery(url: str) -> Gallery:
    rows = Artifact(url).rows()
    return Gallery([Template(r["template_id"], r["text"], tuple(r["slots"]), r["origin"], r["round"])
                    for r in rows], [])


# -- advanced tier ----------------------------------------------------------------------------------

class AdvTier(_TierStage):
    """T_adv per image from a drawn template and its T_base + T_inter; one task per shard."""

    name = "adv-tier"
    version = "4"  # 3: each image's video-track facts go with it into the requests; 4: garbled texts rejected
    reads = ("neighbours", "tier12_captions", "template_gallery", "accepted")
    writes = (Write("captions", "tier_captions", TIER_CAPTIONS, folder="adv_captions"),
              Write("rejects", "rejects", REJECTS, folder="adv_rejects", rejects=True))

    def process(self, run: StageRun, index: int) -> Work:
        rows = run.input("neighbours").read_shard(index).to_pylist()
        earlier = run.input("tier12_captions").read_shard(index, ["image_id", "tier", "text"]).to_pylist()
        texts = {tier: {r["image_id"]: r["text"] for r in earlier if r["tier"] == tier} for tier in ("base", "inter")}
        captioner = TierCaptioner(run.registry().generators(), run.prepared["prompt"], run.section("largefine"))
        items = _tier_images(run.input("accepted").url, rows, False, run.section("track_facts"))
        for item, row in zip(items, rows, strict=True):
            item.negative_id = row["hard_negative_id"]  # recorded on the T_adv row; the image is not needed
        out = TierOutputs()
        captioner.advanced_tier(items, texts["base"], texts["inter"], load_gallery(run.input("template_gallery").url),
                                out)
        tables, stats = _tables(out, len(items))
        return Work.one({"captions": tables["captions"], "rejects": tables["rejects"]}, stats)


# -- export + card ----------------------------------------------------------------------------------

class ExportLargeFine(Stage):
    """The LargeFine-style shards (one row per image and tier, aligned with the captioning
    shards) and all caption rejects in one artifact; then the dataset card. Its input is counted
    from the chosen images (``neighbours``): each ends as one caption or one reject per tier."""

    name = "export-largefine"
    version = "2"
    reads = ("neighbours", "tier12_captions", "tier12_rejects", "adv_captions", "adv_rejects")
    writes = (Write("captions", "tier_captions", TIER_CAPTIONS, folder="largefine"),
              Write("rejects", "rejects", REJECTS, folder="caption_rejects", rejects=True))
    balance = True
    rejects_from_upstream = True  # the tier stages rejected them; counted there

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("tier12_captions").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        order = {tier: i for i, tier in enumerate(TIERS)}
        caps = pa.concat_tables([run.input("tier12_captions").read_shard(index),
                                 run.input("adv_captions").read_shard(index)])
        rows = sorted(caps.to_pylist(), key=lambda r: (r["image_id"], order[r["tier"]]))
        rejects = pa.concat_tables([run.input("tier12_rejects").read_shard(index),
                                    run.input("adv_rejects").read_shard(index)])
        tables = {"captions": pa.Table.from_pylist(rows, schema=TIER_CAPTIONS), "rejects": rejects}
        images = run.input("neighbours").read_shard(index, ["image_id"]).num_rows
        return Work.one(tables, {**sharded.accepted_and_rejected(tables, "captions", "rejects"),
                                 "input_rows": images * len(TIERS), "images": images})

    def report(self, run: StageRun, result: StageResult) -> Report:
        card, stats = dataset_card(run.ctx)
        if "://" not in run.ctx.root:
            write_card(Path(run.ctx.root), card, stats)
        return Report(markdown=[("dataset-card", card_folder_note(run.ctx.root) + card,
                                 "LargeFine-style dataset card (GTR+ Table 1 statistics)")])


WDS_FOLDER = "largefine_wds"


class ExportWebDataset(Stage):
    """With ``largefine.webdataset`` on, the same captions as WebDataset tars in ``largefine_wds/``:
    one tar per captioning shard, one sample per image with a text (its image and a json of its
    tiers' texts, ``q_txt``, hard negative and lineage), and an index shard beside each tar."""

    name = "export-webdataset"
    version = "1"
    reads = ("largefine", "neighbours", "accepted")
    writes = (Write("index", "wds_index", WDS_INDEX, folder=WDS_FOLDER),)
    config = ("largefine.webdataset",)
    title = "WebDataset export: the caption shards as tars (one sample per captioned image)"
    row_unit = "images"

    def applies(self, profile: Any) -> bool:
        return bool(profile.largefine.webdataset)

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("largefine").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        """The tar is stored first (one atomic write), then its index rows; a run stopped between the
        two writes this shard's tar again (the same bytes)."""
        captions = run.input("largefine").read_shard(index).to_pylist()
        chosen = run.input("neighbours").read_shard(index, ["image_id", "accepted_shard"]).to_pylist()
        wanted: dict[int, set[str]] = defaultdict(set)
        for row in chosen:
            wanted[row["accepted_shard"]].add(row["image_id"])
        found = _accepted_rows(run.input("accepted").url, wanted,
                               ["input_id", "source", "domain", "identity", "image_format", "image_bytes"])
        images = [found[row["image_id"]] for row in chosen]
        data, rows = webdataset_export.write_tar(images, captions)
        fs, folder = resolve(run.output_url(WDS_FOLDER))
        name = webdataset_export.tar_name(index)
        atomic_write_bytes(fs, join(folder, name), data, uuid.uuid4().hex[:8])
        digest = sha256_bytes(data)
        table = pa.Table.from_pylist([{**r, "tar": name, "tar_sha256": digest} for r in rows], schema=WDS_INDEX)
        return Work.one({"index": table}, {"input_rows": len(chosen), "accepted": len(rows), "tar_bytes": len(data),
                                           "images_without_text": len(chosen) - len(rows)})

    def report(self, run: StageRun, result: StageResult) -> Report:
        """Tars no index shard names (left by an earlier run with more shards) are removed."""
        fs, folder = resolve(run.output_url(WDS_FOLDER))
        listed = {webdataset_export.tar_name(i) for i in range(self.shard_count(run))}
        for path in fs.ls(folder, detail=False, refresh=True):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".tar") and name not in listed:
                fs.rm(path)
        snippet = "\n".join(WDS_SNIPPET)
        return Report(markdown=[("webdataset", card_folder_note(run.ctx.root) + snippet,
                                 "LargeFine captions as WebDataset tars")])


WDS_SNIPPET = ("WebDataset tars in `largefine_wds/` (one sample per captioned image: the image and a json of its "
               "tiers' texts), read with the `webdataset` library:", "", "```python",
               "import glob, webdataset as wds", "here = \".\"  # this card's folder",
               "tars = sorted(glob.glob(f\"{here}/largefine_wds/*.tar\"))",
               "for sample in wds.WebDataset(tars, shardshuffle=False).decode(\"pil\"):",
               "    image, texts = sample.get(\"jpg\") or sample.get(\"png\"), sample[\"json\"][\"texts\"]",
               "    break", "```")


LARGEFINE_STAGES: tuple[Stage, ...] = (EmbedImages(), HardNegatives(), QaTiers(), TemplateGallery(),
                                       AdvTier(), ExportLargeFine(), ExportWebDataset())
CAPTIONING = ("qa-tiers", "adv-tier")  # the stages whose throughput the run summary reports


CARD_FILES = ("README.md", "card.json")  # beside the artifact folders, never inside one
# The card's Hugging Face header: `load_dataset(run_folder[, "caption_rejects"])` reads these folders.
CARD_TABLES = ("largefine", "caption_rejects")
CARD_CONFIGS = configs_header(CARD_TABLES, default="largefine")


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
    captions = Artifact(ctx.artifact_url("largefine")).rows(["source", "generator"])
    table1 = table1_from_stats([Artifact(ctx.artifact_url(name)).manifest().stats
                                for name in ("tier12_captions", "adv_captions")])
    if table1 is None:  # tier shards written before their counts were kept
        texts = Artifact(ctx.artifact_url("largefine")).rows(["tier", "text"])
        table1 = corpus_statistics({tier: [r["text"] for r in texts if r["tier"] == tier] for tier in TIERS})
    tiers_with_texts = sum(1 for tier in TIERS if table1.get(tier, {}).get("texts"))
    multi = tiers_with_texts > 1
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
             *loading_snippet(CARD_TABLES, default="largefine"), "",
             *([*WDS_SNIPPET, ""] if ctx.profile.largefine.webdataset else []),
             "| texts | #texts | #words/text | #adj./text | #noun chunks/text |", "|---|---|---|---|---|"]
    for name, s in table1.items():
        lines.append(f"| {name} | {s['texts']} | {s['words_per_text']:.2f} | {s['adjectives_per_text']:.2f} | "
                     f"{s['noun_chunks_per_text']:.2f} |")
    lines += ["", f"Multi-granularity: {'yes' if multi else 'no'} (texts of {tiers_with_texts} tiers of detail).",
              "", "| source | ingested | after denoise | texts |", "|---|---|---|---|"]
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
        stats = result.stats
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
