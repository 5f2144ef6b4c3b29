"""What the captioning tier stages (``qa-tiers``, ``adv-tier``) share: their config, resources,
balance and prompt lineage. Not a stage itself."""

from __future__ import annotations

from models.prompt_files import PromptFile, load_prompt
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

    def lineage(self, run: StageRun) -> Lineage:
        prompt = load_prompt(run.section("largefine").tier_prompt)
        run.prepared = prompt
        registry = run.registry()
        return Lineage(models={"generators": [registry.lineage(g) for g in run.models.generators]},
                       prompts={prompt.name: prompt.identity})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("neighbours").manifest().shards)
