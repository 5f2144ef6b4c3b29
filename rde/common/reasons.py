"""The one registry of reason codes for rejected rows, for every stage of every flow.

Every input ends as an accepted row or a rejected row whose ``reason`` is one of these codes; the
runner (``tasks/framework/runner.py``) refuses a stage that reports a code not listed here, so a new reason
is added here, with its one-line meaning, before a stage may use it. A code only one module writes is
declared in that module instead, beside the code that writes it, and a stage that reuses a shared code
declares its use of it there too (``declare_reason``; found through ``rde.common.declarations``): both
join the same registry, the same checks and the same table. The documentation's reason table
(``docs/reference/reasons.md``) is ``reasons_markdown()``, written by ``scripts/gen_reference.py``
(``make docs`` fails when the page is stale).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from rde.common.declarations import REASON_MARKER, import_declaring


class Reason(StrEnum):
    """Why an input was rejected (stored as text in the ``reason`` column)."""

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
    INVALID_PATH = "invalid_path"
    NOT_A_VIDEO = "not_a_video"
    LOW_SCORE = "low_score"
    UNCONFIRMED = "unconfirmed"
    UNSUPPORTED_CODEC = "unsupported_codec"
    NO_FRAMES = "no_frames"
    VIDEO_TOO_LARGE = "video_too_large"
    UNSUPPORTED_URL = "unsupported_url"
    ACCESS_DENIED = "access_denied"
    MISSING_IMAGE = "missing_image"
    UNREADABLE_SHARD = "unreadable_shard"
    UNKNOWN_DOMAIN = "unknown_domain"
    DUPLICATE = "duplicate"
    TOO_SMALL = "too_small"
    BLURRY = "blurry"
    NO_TARGET = "no_target"
    MULTIPLE_TARGETS = "multiple_targets"
    MEASURE_ERROR = "measure_error"
    NOT_SAMPLED = "not_sampled"
    WRONG_CATEGORY = "wrong_category"
    OUT_OF_DOMAIN = "out_of_domain"
    FRAGMENT = "fragment"
    UNGROUNDED_ATTRIBUTE = "ungrounded_attribute"
    REPEATED_SENTENCE = "repeated_sentence"
    EMPTY = "empty"
    TOO_SHORT = "too_short"
    TOO_LONG = "too_long"
    NOT_A_QUERY = "not_a_query"
    DEGENERATE = "degenerate"
    ECHOES_EXAMPLE = "echoes_example"
    OFF_DOMAIN = "off_domain"
    UNSAFE = "unsafe"
    OFF_VOCABULARY = "off_vocabulary"
    NO_KEYWORD = "no_keyword"
    NEAR_DUPLICATE = "near_duplicate"
    OVER_TARGET = "over_target"
    GENERATION_FAILED = "generation_failed"
    UNGROUNDED = "ungrounded"
    REFUSED = "refused"
    UNSUPPORTED = "unsupported"
    TIMEOUT = "timeout"
    MALFORMED_OUTPUT = "malformed_output"
    MALFORMED_QA = "malformed_qa"
    NO_HARD_NEGATIVE = "no_hard_negative"
    MISSING_TIER_INPUT = "missing_tier_input"
    NO_TEMPLATE = "no_template"
    REPETITIVE = "repetitive"
    META_COMMENTARY = "meta_commentary"
    GARBLED = "garbled"
    NOT_ABOUT_PERSON = "not_about_person"
    CONCRETE_DETAIL = "concrete_detail"
    REPEATED_SLOT = "repeated_slot"
    MALFORMED_TEMPLATE = "malformed_template"
    NO_SLOT = "no_slot"
    UNKNOWN_SLOT = "unknown_slot"
    UNMEASURABLE_SLOT = "unmeasurable_slot"
    GALLERY_FULL = "gallery_full"
    SPLIT_GAP = "split_gap"
    NO_MOTION = "no_motion"


# code → (the stages that use it, what it means in one line): the codes above, then those declared
# beside their logic (``declare_reason``) as their modules are imported
MEANINGS: dict[str, tuple[str, str]] = {
    Reason.MISSING_FILE: ("ingest, videos", "the listed file does not exist (any more)"),
    Reason.EMPTY_FILE: ("ingest, videos", "the file has zero bytes"),
    Reason.READ_ERROR: ("ingest, videos", "the file could not be read (permissions, I/O error)"),
    Reason.FILE_TOO_LARGE: ("ingest", "larger than ingest.max_file_bytes"),
    Reason.NOT_AN_IMAGE: ("ingest", "the bytes are no image format the decoder knows"),
    Reason.CORRUPT_IMAGE: ("ingest", "an image format, but decoding failed (truncated, damaged)"),
    Reason.DECOMPRESSION_BOMB: ("ingest", "more pixels than ingest.max_pixels"),
    Reason.UNSUPPORTED_IMAGE: ("ingest", "an image mode or layout the engine does not convert"),
    Reason.OUTSIDE_ROOT: ("ingest, videos", "a path or link that leads outside the input's root"),
    Reason.NOT_A_REGULAR_FILE: ("ingest, videos", "a device, socket or folder where a file was listed"),
    Reason.INVALID_PATH: ("ingest, videos", "a path-list row no file path can be: it holds a NUL byte"),
    Reason.LOW_SCORE: ("videos (tracks)", "a track whose every large enough box scored below video.crop_min_score"),
    Reason.UNCONFIRMED: ("videos (tracks)", "video.confirm_crops: the detector finds no single target on any chosen "
                         "crop of the track"),
    Reason.NOT_A_VIDEO: ("videos", "no video stream in the file: not a container FFmpeg knows, or audio only"),
    Reason.UNSUPPORTED_CODEC: ("videos", "a video stream whose codec this FFmpeg build cannot decode"),
    Reason.NO_FRAMES: ("videos", "a video whose first frame cannot be decoded (zero frames)"),
    Reason.VIDEO_TOO_LARGE: ("videos", "frames with more pixels than video.max_pixels (checked before decoding)"),
    Reason.UNSUPPORTED_URL: ("ingest, videos", "a path-list row that is a URL no installed fsspec store reads, "
                             "a file:// URL, or any URL in a video path list (videos are local files)"),
    Reason.ACCESS_DENIED: ("ingest", "the object store refused to read the object (HTTP 403)"),
    Reason.MISSING_IMAGE: ("ingest", "a WebDataset sample or image-Parquet row that holds no image bytes"),
    Reason.UNREADABLE_SHARD: ("ingest", "an input shard (tar, Parquet) that stops being readable: the rest of it, "
                              "after the samples read before the damage"),
    Reason.UNKNOWN_DOMAIN: ("ingest", "a row names a domain the profile does not declare"),
    Reason.DUPLICATE: ("denoise, dap, template-gallery", "the same pixels (image) or text (query, template) as an "
                       "earlier row"),
    Reason.TOO_SMALL: ("denoise, videos (tracks)", "below the domain's minimum width or height"),
    Reason.BLURRY: ("denoise, videos (tracks)", "Laplacian variance below denoise.min_laplacian_variance"),
    Reason.NO_TARGET: ("denoise", "the detector finds no subject of the image's domain (its subject classes)"),
    Reason.MULTIPLE_TARGETS: ("denoise", "the detector finds more than one target"),
    Reason.MEASURE_ERROR: ("denoise", "the image could not be measured (decode or detector failure)"),
    Reason.NOT_SAMPLED: ("cgds, select-images", "not drawn: its cluster's share or the image cap was filled"),
    Reason.WRONG_CATEGORY: ("cgds", "drawn, but the detector does not see the domain's category"),
    Reason.OUT_OF_DOMAIN: ("select-images", "its domain is not in largefine.domains"),
    Reason.FRAGMENT: ("caption-pool", "not a complete sentence: no subject/verb, a dangling word, a restart"),
    Reason.UNGROUNDED_ATTRIBUTE: ("caption-pool", "states an attribute nothing measured (eyes, age, ...)"),
    Reason.REPEATED_SENTENCE: ("caption-pool", "the same sentence again in one caption (a generation loop)"),
    Reason.EMPTY: ("caption-pool, dap", "nothing left to keep: an empty generation or line"),
    Reason.TOO_SHORT: ("dap, tiers, template-gallery, videos (tracks)", "fewer words than the stage's minimum; a "
                       "track with fewer than video.min_track_detections detections"),
    Reason.TOO_LONG: ("dap, tiers, template-gallery", "more words than the stage's maximum"),
    Reason.NOT_A_QUERY: ("dap", "a question, a label, meta talk or first/second-person speech"),
    Reason.DEGENERATE: ("dap", "a repetition loop"),
    Reason.ECHOES_EXAMPLE: ("dap", "an exact or near copy of a line of the prompt's examples"),
    Reason.OFF_DOMAIN: ("dap", "names no word of its domain"),
    Reason.UNSAFE: ("dap", "a word of prompts/query_safety.yaml"),
    Reason.OFF_VOCABULARY: ("dap", "a content word the domain's caption pool never uses"),
    Reason.NO_KEYWORD: ("dap", "uses none of the keywords sampled into its request"),
    Reason.NEAR_DUPLICATE: ("dap", "text-embedding cosine ≥ queries.near_duplicate_cosine with a kept query"),
    Reason.OVER_TARGET: ("dap", "valid, but queries.per_domain were already kept"),
    Reason.GENERATION_FAILED: ("caption-pool, dap, tiers", "the generator returned an error after its retries"),
    Reason.UNGROUNDED: ("caption-pool, tiers", "the captioner refused to state what it did not measure"),
    Reason.REFUSED: ("caption-pool, tiers", "the generator refused the request"),
    Reason.UNSUPPORTED: ("caption-pool, tiers", "the generator cannot take this input (e.g. no image support)"),
    Reason.TIMEOUT: ("caption-pool, tiers", "the generator did not answer in time, after its retries"),
    Reason.GARBLED: ("caption-pool, dap, tiers", "control or replacement characters: not text (a broken generator)"),
    Reason.MALFORMED_OUTPUT: ("tiers", "not the asked format: Q/A markers in a description, an unfilled [slot]"),
    Reason.MALFORMED_QA: ("qa-tiers", "a Q&A answer with fewer than largefine.min_qa_pairs distinct answered pairs"),
    Reason.NO_HARD_NEGATIVE: ("qa-tiers", "no intermediate tier: the pool holds no other distinct image"),
    Reason.MISSING_TIER_INPUT: ("adv-tier", "no T_adv: the image's T_base or T_inter was rejected"),
    Reason.NO_TEMPLATE: ("adv-tier", "no T_adv: the template gallery is empty"),
    Reason.REPETITIVE: ("tiers", "more than largefine.max_repeated_sentence_share of sentences repeat"),
    Reason.META_COMMENTARY: ("template-gallery", "talks about the task or itself (\"I've created a template\")"),
    Reason.NOT_ABOUT_PERSON: ("template-gallery", "no sentence has the person as its subject or topic"),
    Reason.CONCRETE_DETAIL: ("template-gallery", "keeps a detail a slot should carry (\"a black [top]\")"),
    Reason.REPEATED_SLOT: ("template-gallery", "the same slot twice: one detail would be stated twice"),
    Reason.MALFORMED_TEMPLATE: ("template-gallery", "unbalanced brackets or Q:/A: markers"),
    Reason.NO_SLOT: ("template-gallery", "a template without any [slot]"),
    Reason.UNKNOWN_SLOT: ("template-gallery", "a [slot] outside the slot vocabulary"),
    Reason.UNMEASURABLE_SLOT: ("template-gallery", "a [slot] the captioner cannot measure "
                                                   "(largefine.templates.measurable_slots)"),
    Reason.GALLERY_FULL: ("template-gallery", "valid, but largefine.templates.max_templates were already kept"),
    Reason.SPLIT_GAP: ("vedje-features, motion clips", "a clip between the train and test periods (no test frame "
                                                        "trained on)"),
    Reason.NO_MOTION: ("motion clips", "a clip whose person moves less than MotionParams.min_move × their box height "
                       "(stands still: no direction to caption)"),
}


# Reasons that may pass on another try (a read that failed, a refused credential, a generator that
# failed or timed out): ``--retry-rejects`` redoes the inputs rejected for them (tasks/framework/retry.py).
# Every other reason is a property of the input or of the output, and a rerun gives it again.
TRANSIENT: set[str] = {Reason.READ_ERROR, Reason.ACCESS_DENIED, Reason.GENERATION_FAILED, Reason.TIMEOUT}

_DECLARED: set[tuple[str, str, str]] = set()  # the uses (code, stages, meaning) declare_reason has added


def declare_reason(code: str, stages: str, meaning: str, *, transient: bool = False) -> str:
    """Register a use of a reason code by the calling module, and return the code (a module
    constant: ``OVER_MAX_PAIRS = declare_reason("over_max_pairs", "training-features", "beyond ...")``).

    ``stages``: the stages that write it for this use, as the reasons table names them; ``meaning``:
    what it means there, in a line. A new code gets its row; a known one (the enum's, or another
    module's) gets this use added to its row: the stages after a comma, the meaning after "; ", so a
    stage that reuses a shared code says what the code means for it in its own module.
    ``transient``: ``--retry-rejects`` tries the code again. The same use declared again (a module
    imported twice) changes nothing."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", code):
        raise ValueError(f"reason {code!r}: a reason code is lower-case words joined by _")
    if len(meaning) <= 10 or not stages.strip():
        raise ValueError(f"reason {code!r}: name the stages that write it and say what it means in a line")
    code = str(code)
    use = (code, stages, meaning)
    if use not in _DECLARED:
        _DECLARED.add(use)
        known = MEANINGS.get(code)
        MEANINGS[code] = (stages, meaning) if known is None else (f"{known[0]}, {stages}", f"{known[1]}; {meaning}")
    if transient:
        TRANSIENT.add(code)
    return code


def meanings() -> dict[str, tuple[str, str]]:
    """The registry to read (code → stages, meaning): ``MEANINGS`` once every module that declares a
    code beside its logic has been imported, so no reader misses a declared code."""
    import_declaring(REASON_MARKER)
    return MEANINGS


def known_codes() -> set[str]:
    """Every registered code: the enum's and every declared one."""
    return set(meanings())


# what a rejected row stands for
KINDS = ("image", "video", "shard", "caption", "sentence", "query", "template", "item")


def rejected_row(input_id: str, stage: str, reason: str, *, kind: str, domain: str | None = None,
                 source: str | None = None, image_id: str | None = None, text: str | None = None,
                 detail: str | None = None, all_reasons: list[str] | None = None,
                 **measured: float | int | None) -> dict[str, Any]:
    """One row of the rejects schema (``storage.schemas.REJECTS``), for any stage: ``input_id``
    names what was rejected (an input, an image, a generation request, an item), ``kind`` what it
    is (one of KINDS); ``measured`` holds width, height, laplacian_variance, target_count."""
    if kind not in KINDS:
        raise ValueError(f"rejected_row: kind {kind!r} is not one of {KINDS}")
    return {"input_id": input_id, "kind": kind, "image_id": image_id, "source": source, "domain": domain,
            "stage": stage, "reason": str(reason), "all_reasons": [str(r) for r in (all_reasons or [reason])],
            "text": text, "detail": detail, "width": measured.get("width"), "height": measured.get("height"),
            "laplacian_variance": measured.get("laplacian_variance"), "target_count": measured.get("target_count")}


def unregistered(codes: Iterable[str]) -> list[str]:
    """The codes of ``codes`` that are not in the registry (sorted). The codes a stage writes are
    declared by modules it has imported, so the declaring modules are looked for only when one is
    not (yet) known."""
    wanted = {str(c) for c in codes}
    registry = MEANINGS if wanted <= MEANINGS.keys() else meanings()
    return sorted(wanted - registry.keys())


def reasons_markdown() -> str:
    """The reasons table of docs/reference/reasons.md: every code, the stages that use it, its meaning:
    the shared codes in their order, then the declared ones by code."""
    registry = meanings()
    shared = {str(r) for r in Reason}
    order = [code for code in registry if code in shared] + sorted(set(registry) - shared)
    lines = ["| reason | stages | meaning |", "|---|---|---|"]
    again = " (transient: `--retry-rejects` tries it again)"
    lines += [f"| `{code}` | {stages} | {meaning}{again if code in TRANSIENT else ''} |"
              for code in order for stages, meaning in [registry[code]]]
    return "\n".join(lines)
