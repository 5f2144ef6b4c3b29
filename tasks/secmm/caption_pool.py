"""The caption-pool stage: captions for DAP's statistics, from a user's caption file or the profile's
first generator on a seeded sample of the denoised pool (per domain)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from models.backends.interfaces import ChatMessage, GenerationRequest
from models.backends.slot_layout import slot_layout
from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde.common.image_decoding import decoded_images
from rde.common.text_diversity import diversity_by_domain, diversity_line
from rde.common.track_context import track_facts
from rde.secmm import sentence_checks
from rde.secmm.caption_file import captions_from_file, file_caption_count
from rde.secmm.caption_pool import IMAGE_STAGE, SENTENCE_STAGE, pool_caption
from storage.locations import resolve_location
from storage.schemas import (
    CAPTIONS,
    REJECTS,
)
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class CaptionSource:
    """Where the captions come from, decided by ``lineage``: the caption prompt, the generator (None
    without one) and the user's caption file (None: caption the pool)."""

    prompt: Any
    generator: ModelSpec | None
    caption_file: str | None


class CaptionPool(Stage):
    """Captions for DAP statistics: a user caption file, or the profile's first generator on a
    seeded sample of the denoised pool (per domain)."""

    name = "caption-pool"
    # 4: repeated sentences, verbs without object and colours without noun dropped; 5: the images'
    # track facts (motion, direction, distance) go to the captioner and into rendered captions;
    # 6: garbled sentences (control or replacement characters) dropped
    version = "6"
    reads = ("accepted",)
    writes = (Write("caption_pool", "captions", CAPTIONS),
              Write("caption_pool_rejects", "rejects", REJECTS, rejects=True))
    config = ("queries.caption_file", "queries.caption_sample_per_domain", "queries.caption_max_tokens",
              "queries.seed", "input.default_domain", "track_facts", "domains")
    resources = Resources(device="gpu", hold_slot=False)  # the captioner (an MLLM in production)
    prepares = CaptionSource
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        queries = run.section("queries")
        prompt = load_prompt("caption_pool")
        gen_spec = run.models.generators[0] if run.models.generators else None
        caption_file = resolve_location(queries.caption_file) if queries.caption_file else None
        run.prepared = CaptionSource(prompt, gen_spec, caption_file)
        return Lineage(models={"generator": run.registry().lineage(gen_spec)},
                       prompts={"caption_pool": prompt.identity}, extra={"file": caption_file})

    def run(self, run: StageRun) -> Work:
        source: CaptionSource = run.prepared
        q, prompt, gen_spec = run.section("queries"), source.prompt, source.generator
        if source.caption_file:
            path = Path(source.caption_file)
            captions = pa.Table.from_pylist(captions_from_file(path, run.section("input").default_domain),
                                            schema=CAPTIONS)
            return Work.one({"caption_pool": captions, "caption_pool_rejects": REJECTS.empty_table()},
                            {"input_rows": file_caption_count(path), "accepted": captions.num_rows})
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
        domains = run.domains
        for domain in sorted({r["domain"] for r in rows} & set(domains.names)):
            mine = [r for r in rows if r["domain"] == domain]
            pick = rng.choice(len(mine), size=min(q.caption_sample_per_domain, len(mine)), replace=False)
            chosen = [mine[i] for i in sorted(pick)]
            images = decoded_images(accepted, [r["image_id"] for r in chosen])
            tracks = track_facts(accepted, [r["image_id"] for r in chosen], run.section("track_facts"), domains)
            requests = [GenerationRequest(r["image_id"], [ChatMessage("user", domains[domain].captions.request,
                                                                      [images[r["image_id"]]],
                                                                      [tracks.get(r["image_id"], {})])],
                                          max_tokens=q.caption_max_tokens, temperature=0.0)
                        for r in chosen]
            generated += len(requests)
            results = generator.generate(requests)
            # complete sentences only, and (where the generator measured facts) only what was measured
            facts = [measured([images[r.request_id]], [tracks.get(r.request_id, {})])[0] if measured else None
                     for r in results]
            subject = domains[domain].subject  # its nouns state no attribute of it
            checks = sentence_checks.check_captions([r.text if r.ok else "" for r in results],
                                                    [f.allowed if f else None for f in facts],
                                                    generic | set(subject.allowed) | {subject.noun},
                                                    int(prompt.extras.get("restart_ngram", 3)),
                                                    needs_object=prompt.extras.get("needs_object", []))
            from_facts = domains[domain].captions.from_facts
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
                 "diversity": diversity_by_domain(captions, slot_layout(domains))}
        return Work.one({"caption_pool": pa.Table.from_pylist(captions, schema=CAPTIONS),
                         "caption_pool_rejects": pa.Table.from_pylist(rejects, schema=REJECTS)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(tables=[("caption-pool-diversity", stats.get("diversity") or [{"domain": "-"}],
                               "Caption pool: how varied the captions DAP samples from are, per domain")],
                      log=f"caption-pool: {result.accepted}/{result.input_rows} captions kept, sentences dropped "
                          f"{stats.get('dropped_sentences', {})}, {stats.get('rendered_from_facts', 0)} said "
                          "from the measured facts; " + diversity_line(stats.get("diversity") or []))
