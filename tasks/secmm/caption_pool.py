"""The caption-pool stage: captions for DAP's statistics, from a user's caption file or the profile's
first generator on a seeded sample of the denoised pool (per domain)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from models.prompt_files import load_prompt
from models.specs import ModelSpec
from rde.common.text_diversity import diversity_line
from rde.secmm.caption_file import captions_from_file, file_caption_count
from rde.secmm.caption_pool import caption_sample
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
        captions, rejects, stats = caption_sample(generator, run.input("accepted"), run.domains, q, prompt,
                                                  run.section("track_facts"))
        return Work.one({"caption_pool": pa.Table.from_pylist(captions, schema=CAPTIONS),
                         "caption_pool_rejects": pa.Table.from_pylist(rejects, schema=REJECTS)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(tables=[("caption-pool-diversity", stats.get("diversity") or [{"domain": "-"}],
                               "Caption pool: how varied the captions DAP samples from are, per domain")],
                      log=f"caption-pool: {result.accepted}/{result.input_rows} captions kept, sentences dropped "
                          f"{stats.get('dropped_sentences', {})}, {stats.get('rendered_from_facts', 0)} said "
                          "from the measured facts; " + diversity_line(stats.get("diversity") or []))
