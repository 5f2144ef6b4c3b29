"""build-secmm's profile sections that more than one module of this package reads: ``queries``
(DAP: dap.py, its grammar and post-processing, and the caption pool) and ``review`` (benchmark.py,
review_site.py). A section one module alone reads is declared in that module
(``rde.common.declarations``): ``near_duplicates`` in near_duplicates.py, ``sampling`` in cgds.py,
``retrieval`` in mecf.py.

``rde.profile`` composes them into a ``Profile``; this module imports nothing above ``rde.common``, so
the secmm logic imports it downward, as it imports its own modules.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from models.specs import Strict

__all__ = ["QueriesSpec", "ReviewSpec"]


class ReviewSpec(Strict):
    """The human review of the MECF candidates (DSMM-TBIR Phase 3): the static review site and the
    Label Studio tasks written next to the benchmark."""

    page_size: int = Field(48, ge=1, le=1000, description="Candidates per page of the review site, and per "
                           "Label Studio task (a query with more candidates becomes several tasks).")
    thumbnail_height: int = Field(256, ge=16, le=4096, description="Gallery images taller than this are "
                                  "scaled down for the review's images/ folder; smaller ones are copied as "
                                  "they are.")
    label_studio_images: str | None = Field(None, description="Base URL under which Label Studio reads the "
                                            "review's images/ folder, when the server runs elsewhere (a web "
                                            "server or bucket that publishes the folder). Unset: Label Studio's "
                                            "local-files serving on this machine (/data/local-files/?d=<the "
                                            "image's absolute path>, with LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT=/"
                                            ").")


class QueriesSpec(Strict):
    """Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1, Table 11) and query post-processing."""

    per_domain: int = Field(100, ge=1, description="Queries kept per domain; valid ones beyond it are "
                            "rejected as over_target.")
    min_words: int = Field(5, ge=1, description="Shorter queries are rejected as too_short (words).")
    max_words: int = Field(15, ge=1, description="Longer queries are rejected as too_long (words; at least "
                           "min_words).")
    per_request: int = Field(10, ge=1, description="Queries asked for in one prompt (its [part_num]).")
    keywords_per_pos: int = Field(12, ge=1, description="Nouns, verbs and adjectives (each) sampled from the "
                                  "caption pool into each prompt.")
    max_rounds: int = Field(10, ge=1, description="Prompts per domain at most while per_domain is not reached.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature of the query generator.")
    max_tokens: int = Field(256, ge=16, description="Token budget of one query-generation answer.")
    near_duplicate_cosine: float = Field(0.92, gt=0.0, le=1.0, description="A query whose text-embedding "
                                         "cosine with a kept query is at least this is a near_duplicate.")
    near_duplicate_attributes: bool = Field(True, description="Count a near duplicate only when both queries "
                                            "state the same attribute values (\"red top\" and \"black top\" "
                                            "stay two queries).")
    echo_max_word_edits: int = Field(1, ge=0, description="A query at most this many words away from a line "
                                     "of the prompt's examples is rejected as echoes_example.")
    echo_span_content_words: int = Field(3, ge=1, description="A run copied from the examples that holds this "
                                         "many content words makes a query echoes_example.")
    vocabulary_check: bool = Field(True, description="Reject as off_vocabulary a query with a content word the "
                                   "domain's caption pool never uses.")
    keyword_check: bool = Field(True, description="Reject as no_keyword a query that uses no noun or adjective "
                                "sampled into its request.")
    # honoured by llama.cpp (offline, and servers through openai-http's grammar_field)
    constrained_decoding: bool = Field(False, description="Constrain generation with a GBNF grammar built per "
                                       "request from its sampled keywords and caption-pool phrases (llama.cpp "
                                       "backends).")
    grammar_phrases: int = Field(6, ge=1, description="Caption-pool phrases per sampled keyword offered in the "
                                 "grammar.")
    grammar_min_count: int = Field(2, ge=1, description="A noun enters the grammar once this many pool "
                                   "captions use it.")
    # fewer is often a measurement slip: "red bottoms" from a red jacket's hem
    grammar_min_pair_count: int = Field(3, ge=1, description="An adjective on a noun, a pair of nouns or a "
                                        "noun as subject enters the grammar once this many pool captions say it.")
    caption_sample_per_domain: int = Field(40, ge=1, description="Images per domain captioned for the caption "
                                           "pool that the query statistics come from.")
    caption_max_tokens: int = Field(80, ge=8, description="Token budget of one caption-pool caption (one or "
                                    "two sentences).")
    caption_file: str | None = Field(None, description="A CUHK-PEDES-style JSON file of captions to use as "
                                     "the caption pool instead of captioning images.")
    seed: int = Field(0, description="Seed of the caption sample, the keyword draws and the generator.")

    @model_validator(mode="after")
    def _lengths(self) -> QueriesSpec:
        if self.min_words > self.max_words:
            raise ValueError("queries.min_words must not exceed queries.max_words")
        return self
