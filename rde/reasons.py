"""Reason codes for rejected rows. Every input ends accepted or rejected with one of these."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why an input was rejected (stored as text in the ``reason`` column)."""

    # ingest: the input could not become an image
    MISSING_FILE = "missing_file"
    EMPTY_FILE = "empty_file"
    READ_ERROR = "read_error"
    FILE_TOO_LARGE = "file_too_large"
    NOT_AN_IMAGE = "not_an_image"
    CORRUPT_IMAGE = "corrupt_image"
    DECOMPRESSION_BOMB = "decompression_bomb"
    UNSUPPORTED_IMAGE = "unsupported_image"
    OUTSIDE_ROOT = "outside_root"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    UNKNOWN_DOMAIN = "unknown_domain"
    # denoise: the image is real but not usable
    DUPLICATE = "duplicate"
    TOO_SMALL = "too_small"
    BLURRY = "blurry"
    NO_TARGET = "no_target"
    MULTIPLE_TARGETS = "multiple_targets"
    MEASURE_ERROR = "measure_error"
    # template gallery: a generated candidate that is not a caption pattern (rde/template_gallery.py)
    META_COMMENTARY = "meta_commentary"  # talks about the task or itself ("I've created a template ...:")
    NOT_ABOUT_PERSON = "not_about_person"  # no sentence has the person as its subject or topic
    CONCRETE_DETAIL = "concrete_detail"  # keeps a detail a slot should carry ("a black [top description]")
    REPEATED_SLOT = "repeated_slot"  # the same slot twice: the caption would state one detail twice
    # caption pool (tasks/secmm.py, rde/sentence_checks.py): one dropped sentence of a pool caption
    FRAGMENT = "fragment"  # not a complete sentence: no subject/verb, a dangling last word, a restart
    UNGROUNDED_ATTRIBUTE = "ungrounded_attribute"  # states an attribute nothing measured (eyes, age, ...)
    REPEATED_SENTENCE = "repeated_sentence"  # the same sentence again in one caption (a generation loop)
    # DAP queries (rde/dap.py): a generated line that is not kept
    EMPTY = "empty"
    TOO_SHORT = "too_short"
    TOO_LONG = "too_long"
    NOT_A_QUERY = "not_a_query"  # a question, a label, meta talk or first/second-person speech
    DEGENERATE = "degenerate"  # a repetition loop
    ECHOES_EXAMPLE = "echoes_example"  # an exact or near copy of a line of the prompt's [Output Examples]
    OFF_DOMAIN = "off_domain"  # no domain word
    UNSAFE = "unsafe"  # a word of prompts/query_safety.yaml
    OFF_VOCABULARY = "off_vocabulary"  # a content word the domain's caption pool never uses
    NO_KEYWORD = "no_keyword"  # uses none of the nouns/adjectives sampled into its request
    NEAR_DUPLICATE = "near_duplicate"  # text-embedding cosine ≥ queries.near_duplicate_cosine with a kept one
    OVER_TARGET = "over_target"  # valid, but queries.per_domain were already kept
    GENERATION_FAILED = "generation_failed"
