"""The template gallery keeps only caption patterns: the generator's chatter about the task
("I've created a custom template ...") is rejected with ``meta_commentary``, by spaCy's parse first
and the prompt file's cue lists second; half-extracted captions with ``concrete_detail``; sentences
not about the person with ``not_about_person``."""

from __future__ import annotations

import dataclasses

import pytest
from scripted_generator import ScriptedGenerator

from models.backends.interfaces import GenerationRequest
from models.prompt_files import load_prompt
from rde.common.reasons import Reason
from rde.largefine.template_gallery import (
    CaptionPatternCheck,
    CaptionPatternRules,
    GalleryBuilder,
    build_gallery,
    split_template_lines,
    validate_template,
)

PROMPT = load_prompt("gtr_template_gallery")
RULES = CaptionPatternRules.from_mapping(PROMPT.extras["caption_pattern"])
SLOTS = PROMPT.extras["slots"]

# The accepted "template" of the demo gallery and two paraphrases of it.
CHATTER = [
    "I've created a custom template that uses the specified slots: [person/man/woman], [top description], "
    "[bottom description]. Here's a sample of the template:",
    "Here is a new template with the slots [person/man/woman], [top description] and [bottom description]. "
    "Below is an example of how it reads:",
    "This template fills [person/man/woman], [top description] and [bottom description] and a sample of it "
    "follows",
]
# Caption patterns in shapes the seeds do not cover (generated ones seen in demo galleries).
PATTERNS = [
    "Wearing [top description] and [bottom description], the [person/man/woman] waits at the crossing.",
    "The [person/man/woman], [age description], wears [top description] and [footwear description].",
    "Their [top description] matches the [bottom description] of the [person/man/woman].",
    "The person in the image is wearing [top description] paired with [bottom description]. The "
    "[person/man/woman] walks past.",  # accepted in a demo gallery (64 images, 8 rounds)
    "The [person/man/woman] wears [colour description] clothing and [shoes description].",
    "A [person/man/woman] with [hair description] in [clothing description].",
]


@pytest.fixture(scope="module")
def check() -> CaptionPatternCheck:
    return CaptionPatternCheck(RULES)


@pytest.mark.parametrize("text", CHATTER)
def test_chatter_about_the_task_is_meta_commentary(check: CaptionPatternCheck, text: str) -> None:
    """The issue's example and its paraphrases pass the old checks but are not caption patterns."""
    assert GalleryBuilder(SLOTS, 6, 60, 64).add(text, "expanded", 2)  # the old checks let it in
    builder = GalleryBuilder(SLOTS, 6, 60, 64, check)
    assert not builder.add(text, "expanded", 2)
    assert not builder.gallery.templates
    [reject] = builder.gallery.rejected
    assert (reject.reason, reject.text, reject.origin) == (Reason.META_COMMENTARY, text, "expanded")


@pytest.mark.parametrize("text", CHATTER)
def test_the_parse_alone_rejects_chatter(text: str) -> None:
    """Without any cue words, phrases, colon or slot-list rule the structural test still rejects it."""
    bare = CaptionPatternCheck(dataclasses.replace(RULES, meta_words=frozenset(), meta_phrases=(),
                                                   slot_list_min=10**6))
    bad = bare(text.rstrip(":"))
    assert bad is not None and bad[0] in {Reason.META_COMMENTARY, Reason.NOT_ABOUT_PERSON}


@pytest.mark.parametrize("text", [*PROMPT.extras["seeds"], *PATTERNS])
def test_caption_patterns_pass(check: CaptionPatternCheck, text: str) -> None:
    assert check(text) is None


@pytest.mark.parametrize(("text", "reason"), [
    ("Describe the [person/man/woman] in [top description] and [bottom description].", Reason.META_COMMENTARY),
    ("The [person/man/woman] wears [top description], as you asked.", Reason.META_COMMENTARY),
    ("[person/man/woman]: [top description], [bottom description], [footwear description]",
     Reason.META_COMMENTARY),
    ("The [person/man/woman] wears [top description] and [bottom description] as follows:",
     Reason.META_COMMENTARY),  # cue: trailing colon
    ("[person/man/woman], [top description], [bottom description] and [footwear description].",
     Reason.META_COMMENTARY),  # cue: slot list
    ("Of course, the [person/man/woman] wears [top description] and [bottom description].",
     Reason.META_COMMENTARY),  # cue: framing phrase
    ("The [person/man/woman] wears [top description] and [bottom description] in this template.",
     Reason.META_COMMENTARY),  # cue: meta word
    ("[person/man/woman] wearing a black top and carrying a black [clothing description]",
     Reason.CONCRETE_DETAIL),  # seen in a demo gallery (64 images, 8 rounds)
    ("[person/man/woman] (the person wears a black top)", Reason.CONCRETE_DETAIL),  # ditto
    ("[top description] goes well with [bottom description] on a sunny day.", Reason.NOT_ABOUT_PERSON),
    ("A new design fills the [person/man/woman] with [top description] and [bottom description].",
     Reason.NOT_ABOUT_PERSON),
])
def test_other_non_patterns(check: CaptionPatternCheck, text: str, reason: Reason) -> None:
    bad = check(text)
    assert bad is not None and bad[0] == reason, bad


def test_build_gallery_keeps_chatter_in_the_rejects() -> None:
    """End to end with a scripted generator: the expand round's chatter lands in the rejects."""
    def script(request: GenerationRequest) -> str:
        if request.request_id.startswith("extract"):
            return "1. " + PATTERNS[0]
        return "\n".join(f"{i}. {t}" for i, t in enumerate([CHATTER[0], PATTERNS[1]], 1))

    gallery = build_gallery(ScriptedGenerator(script).generate, ["c1"], PROMPT, captions_per_request=1, rounds=1,
                            max_templates=64, min_words=6, max_words=60, max_tokens=64, temperature=0.7, seed=0)
    texts = [t.text for t in gallery.templates]
    assert texts[-2:] == PATTERNS[:2] and CHATTER[0] not in texts
    assert [(r.reason, r.text) for r in gallery.rejected] == [(Reason.META_COMMENTARY, CHATTER[0])]


def test_letter_list_markers_and_repeated_slots() -> None:
    """Seen in a demo gallery (64 images, 8 rounds): "d. The [person/man/woman] carries ..." lost to its
    list marker, and "In [top description] ..., the [person/man/woman] walks here wearing [top description]"."""
    assert split_template_lines("c. A [person/man/woman] in [top description].\nd) The [person/man/woman] waits.") \
        == ["A [person/man/woman] in [top description].", "The [person/man/woman] waits."]
    text = ("In [top description] and [bottom description], the [person/man/woman] walks here wearing "
            "[top description] over [bottom description].")
    bad = validate_template(text, SLOTS, min_words=6, max_words=60)
    assert bad is not None and bad[0] == Reason.REPEATED_SLOT
