"""What the captioning tier stages (``qa-tiers``, ``adv-tier``) share: their config, resources,
balance and prompt lineage. Not a stage itself."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from models.prompt_files import PromptFile, load_prompt
from rde.largefine.tier_inputs import table1_counts
from tasks.framework.stage import Lineage, Resources, Stage, StageRun

GENERATION = (*(f"largefine.{name}" for name in (
    "temperature", "qa_max_tokens", "summary_max_tokens", "min_qa_pairs", "min_words", "max_words",
    "max_repeated_sentence_share", "drop_repeated_sentences", "boilerplate", "negative_mentions", "seed",
    "tier_prompt", "retries")), "track_facts", "domains")  # the images' video-track facts go into the requests; retries
# decide whether a call that failed for a transient reason ends as a caption or a reject


class TierStage(Stage):
    """A captioning tier: the profile's generators with the tier prompt, one task per neighbours
    shard holding a GPU slot; every (image, tier) asked for ends as a caption or a reject."""

    config = GENERATION
    resources = Resources(device="gpu")
    balance = True
    prepares = PromptFile  # the tier prompt
    retry_by = "image_id"  # an image whose caption failed for a transient reason is asked again on --retry-rejects

    def removed_stats(self, removed: dict[str, pa.Table]) -> dict[str, Any]:
        """The retried images' share of the shard's ``images`` and Table 1 word counts."""
        captions = next(t for name, t in removed.items() if name.endswith("_captions"))
        images = set().union(*(t.column("image_id").to_pylist() for t in removed.values()))
        return {"images": len(images), **table1_counts(captions.select(["text", "tier"]).to_pylist())}

    def neighbour_rows(self, run: StageRun, index: int) -> list[dict[str, Any]]:
        """The shard's neighbours rows: its images (only those retried, on a retry)."""
        rows = run.input("neighbours").read_shard(index).to_pylist()
        return rows if run.retry_only is None else [r for r in rows if r["image_id"] in run.retry_only]

    def lineage(self, run: StageRun) -> Lineage:
        prompt = load_prompt(run.section("largefine").tier_prompt)
        run.prepared = prompt
        registry = run.registry()
        return Lineage(models={"generators": [registry.lineage(g) for g in run.models.generators]},
                       prompts={prompt.name: prompt.identity})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("neighbours").manifest().shards)
