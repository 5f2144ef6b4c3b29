"""build-largefine's profile section (``largefine``), beside its logic in this package: the tiers'
prompts, shards and generation limits (tiered_captions.py, qa_pairs.py, caption_quality.py), the hard
negatives' neighbours (hard_negatives.py; its ANN index is ``rde.common.topk``'s), the retries of
transient generator failures and the template gallery of the advanced tier (template_gallery.py).

``rde.profile`` composes it into a ``Profile``; this module imports nothing above ``rde.common``.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from models.specs import Strict
from rde.common.topk import AnnSpec


class RetrySpec(Strict):
    """Generator calls that fail for a transient reason (timeout, server error) are retried with
    exponential backoff, then recorded as rejected rows."""

    max_attempts: int = Field(3, ge=1, description="Calls per request in all, the first included.")
    backoff_s: float = Field(0.5, ge=0.0, description="Wait before the first retry, doubled for each next one "
                             "(seconds).")


class TemplateGallerySpec(Strict):
    """GTR+ advanced tier: the extract-and-expand loop that builds the template gallery."""

    sample_captions: int = Field(24, ge=1, description="Tier-1/2 captions sampled as the extraction round's "
                                 "input.")
    captions_per_request: int = Field(6, ge=1, description="Captions shown in one extraction request.")
    rounds: int = Field(2, ge=0, description="Expansion rounds after the extraction round.")
    max_templates: int = Field(64, ge=1, description="Templates kept; valid ones beyond it are rejected as "
                               "gallery_full.")
    min_words: int = Field(6, ge=1, description="Shorter templates are rejected as too_short (words).")
    max_words: int = Field(60, ge=1, description="Longer templates are rejected as too_long (words).")
    max_tokens: int = Field(256, ge=16, description="Token budget of one template-generation answer.")
    temperature: float = Field(0.7, ge=0.0, description="Sampling temperature of the template generator.")
    seed: int = Field(0, description="Seed of the caption sample and the generator.")
    measurable_slots: list[str] | None = Field(None, description="The slots the captioner can fill from what it "
                                               "measures; a template with another slot is rejected as "
                                               "unmeasurable_slot (null: every slot of the prompt file's "
                                               "vocabulary, for an MLLM that sees hair and shoes).")


class LargeFineSpec(Strict):
    """``build-largefine``: GTR+ three-tier captioning (paper Sec. 3.1) into LargeFine-style shards."""

    domains: list[str] = Field(default_factory=list, description="Domains captioned (unset: the profile's first "
                               "domain); images of other domains are rejected as out_of_domain.")
    tier_prompt: str = Field("gtr_tiers", description="Prompt file prompts/<name>.yaml of the tiers: gtr_tiers "
                             "has the paper's wording, gtr_tiers_small suits tiny LLMs.")
    shard_size: int = Field(64, ge=1, description="Images per captioning task.")
    max_images: int | None = Field(None, ge=1, description="Cap on the accepted images captioned; null = all.")
    neighbours_k: int = Field(10, ge=1, description="The hard negative is drawn from this many nearest "
                              "neighbours of an image (paper Eq. 1).")
    neighbour_index_above: int = Field(100_000, ge=1, description="Pool size above which the neighbours are "
                                       "searched in an approximate (ANN) index.")
    neighbour_ann: AnnSpec = Field(default_factory=AnnSpec, description="That approximate index and its recall "
                                   "check.")
    seed: int = Field(0, description="Seed of the hard-negative draw, the generator assignment and the "
                      "template choice.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the tier generators (0 = "
                               "greedy).")
    qa_max_tokens: int = Field(256, ge=16, description="Token budget of one Q&A answer (base and intermediate "
                               "tiers).")
    summary_max_tokens: int = Field(160, ge=16, description="Token budget of one summary (every tier's "
                                    "text is one).")
    min_qa_pairs: int = Field(2, ge=1, description="A Q&A answer with fewer distinct answered pairs is "
                              "rejected as malformed_qa.")
    min_words: int = Field(10, ge=1, description="A tier text with fewer words is rejected as too_short.")
    max_words: int = Field(200, ge=1, description="A tier text with more words is rejected as too_long.")
    max_repeated_sentence_share: float = Field(0.5, ge=0.0, le=1.0, description="A text with a larger share of "
                                               "repeated sentences (as generated) is rejected as repetitive.")
    drop_repeated_sentences: bool = Field(True, description="Keep only a sentence's first occurrence (each drop "
                                          "recorded in the row's cleaning).")
    boilerplate: list[str] = Field(default_factory=lambda: [
        "in the image", "in this image", "in the picture", "in the photo", "the image shows", "this image shows",
        "the picture shows", "in the target-image", "in target-image"],
        description="Phrases removed from every tier's text.")
    negative_mentions: list[str] = Field(default_factory=lambda: [
        "compare-image", "compare image", "both persons", "both of them", "the other person", "second person"],
        description="Phrases that name the hard-negative image, removed from intermediate and advanced texts.")
    retries: RetrySpec = Field(RetrySpec(), description="Retries of generator calls that fail for a transient "
                               "reason.")
    templates: TemplateGallerySpec = Field(TemplateGallerySpec(), description="The template gallery of the "
                                           "advanced tier.")
    webdataset: bool = Field(False, description="Also write the captions as WebDataset tar shards "
                             "(largefine_wds/): one sample per image, its image and a json of its tiers' texts.")

    @model_validator(mode="after")
    def _lengths(self) -> LargeFineSpec:
        if self.min_words > self.max_words:
            raise ValueError("largefine.min_words must not exceed largefine.max_words")
        return self
