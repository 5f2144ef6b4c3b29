"""GTR+ tiered captioning logic: Q&A parsing, quality gates, retries, q_txt, the three tiers and
the template gallery, with a scripted generator (the flows use real ones)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scripted_generator import ScriptedGenerator

from models.backends.interfaces import GenerationRequest, GenerationResult, TokenLogprob
from models.prompt_files import load_prompt
from rde.common.generation_retries import generate_with_retries
from rde.largefine.caption_quality import (
    drop_negative_mentions,
    drop_repeated_sentences,
    gate_caption,
    repeated_sentence_share,
    strip_boilerplate,
)
from rde.largefine.config import LargeFineSpec
from rde.largefine.qa_pairs import format_qa_pairs, parse_qa_pairs
from rde.largefine.template_gallery import (
    GalleryBuilder,
    build_gallery,
    split_template_lines,
    template_key,
    validate_template,
)
from rde.largefine.tiered_captions import TierCaptioner, TierImage, TierOutputs, assign_generator

GATES = {"min_words": 10, "max_words": 200, "boilerplate": LargeFineSpec().boilerplate,
         "max_repeated_sentence_share": 0.5}


# -- q_txt ------------------------------------------------------------------------------------------

def test_q_txt_is_the_mean_token_probability_not_the_product() -> None:
    """GTR+ Eq. 8 by hand: p = 0.9, 0.5, 0.1 → q_txt = 1.5 / 3 = 0.5 (the product would be 0.045)."""
    tokens = [TokenLogprob("a", math.log(0.9)), TokenLogprob("b", math.log(0.5)), TokenLogprob("c", math.log(0.1))]
    result = GenerationResult("r", "a b c", tokens, "m")
    assert result.mean_token_probability == pytest.approx(0.5)
    assert GenerationResult("r", "", [], "m").mean_token_probability is None


# -- Q&A parsing -------------------------------------------------------------------------------------

def test_qa_pairs_parsed_leniently_and_deduplicated() -> None:
    text = ("Q1: What is on the top?\nA1: A red coat.\nQ2: Shoes?\nQ3: Bag?  A3: A black bag. "
            "**Q4:** What is on the top? **A4:** A red coat.  Question 5) Hair? Answer 5) Short.")
    pairs = parse_qa_pairs(text)
    assert [(p.question, p.answer) for p in pairs] == [("What is on the top?", "A red coat."),
                                                        ("Bag?", "A black bag."), ("Hair?", "Short.")]
    assert format_qa_pairs(pairs[:1]) == "Q1: What is on the top?\nA1: A red coat."
    assert parse_qa_pairs("A man walks by. Grade A: fine") == []  # no question before the answer


# -- quality gates -----------------------------------------------------------------------------------

def test_boilerplate_is_stripped_and_sentences_recapitalised() -> None:
    out = strip_boilerplate("The person in the image wears a red coat. in this image, the man walks.",
                            ["in the image", "in this image"])
    assert out == "The person wears a red coat. The man walks."


@pytest.mark.parametrize(("text", "reason"), [
    ("A red coat.", "too_short"),
    (" ".join("".join(w) for w in itertools.product("abcdefg", repeat=3))[:201 * 4] + ".", "too_long"),
    ("Q1: What is worn? A1: A red coat and blue jeans with white shoes and a bag.", "malformed_output"),
    ("The [person/man/woman] wears a red coat with blue jeans and white shoes today.", "malformed_output"),
    ("The person wears a red coat today. The person wears a red coat today. The person wears a red coat today.",
     "repetitive"),
    ("The person wears a red coat, blue jeans and white shoes, and carries a black bag.", None),
])
def test_quality_gates(text: str, reason: str | None) -> None:
    assert gate_caption(text, **GATES).reason == reason


def test_negative_mentions_are_cut_from_comparison_texts() -> None:
    text = ("The person wears a black top while the person in Compare-Image wears a red top. "
            "Both persons wear white bottoms. The person carries a small bag in the left hand.")
    kept, removed = drop_negative_mentions(text, ["compare-image", "both persons"])
    assert kept == "The person wears a black top. The person carries a small bag in the left hand."
    assert removed == 2
    assert gate_caption(text, negative_mentions=["compare-image", "both persons"], **GATES).text == kept


def test_repeated_sentences_are_dropped_before_the_gates_decide() -> None:
    """The demo's own example: the repeats go (first occurrence kept), the text passes,
    and the row can say what was removed; the share of repeats as generated still decides
    ``repetitive``."""
    text = ("The person's top is black. The person wears black bottoms. The person wears black bottoms. "
            "The person wears black bottoms.")
    assert drop_repeated_sentences(text) == ("The person's top is black. The person wears black bottoms.", 2)
    gate = gate_caption(text, **GATES)
    assert gate.reason is None and gate.text == "The person's top is black. The person wears black bottoms."
    assert gate.cleaning == ("repeated_sentences:2",) and repeated_sentence_share(gate.text) == 0
    assert gate_caption(text, drop_repeats=False, **GATES).text == text  # the switch keeps the old behaviour
    short = "A man in a red coat walks. A man in a red coat walks. He runs."
    rejected = gate_caption(short, **GATES)
    assert rejected.reason == "too_short" and rejected.text == "A man in a red coat walks. He runs."
    assert "before dropping repeats 16 words, 33% repeated" in rejected.detail
    assert gate_caption(short, drop_repeats=False, **GATES).reason is None
    assert drop_repeated_sentences("The coat is red. the coat is RED! A bag.") == ("The coat is red. A bag.", 1)


# -- retries -----------------------------------------------------------------------------------------

def test_transient_failures_are_retried_with_backoff_then_recorded() -> None:
    failures = {"flaky": 1, "dead": 99}

    def script(request: GenerationRequest) -> str | Exception:
        if failures.get(request.request_id, 0) > 0:
            failures[request.request_id] -= 1
            return RuntimeError("timeout after 60s")
        if request.request_id == "refused":
            return RuntimeError("refused: content_filter")
        return "fine"

    gen, waits = ScriptedGenerator(script), []
    results = generate_with_retries(gen, [GenerationRequest(i, []) for i in ("ok", "flaky", "dead", "refused")],
                                    max_attempts=3, backoff_s=0.5, sleep=waits.append)
    by_id = {r.request_id: r for r in results}
    assert [r.request_id for r in results] == ["ok", "flaky", "dead", "refused"]
    assert by_id["ok"].ok and by_id["ok"].attempts == 1
    assert by_id["flaky"].ok and by_id["flaky"].attempts == 2
    assert not by_id["dead"].ok and by_id["dead"].attempts == 3
    assert not by_id["refused"].ok and by_id["refused"].attempts == 1  # permanent: not asked again
    assert waits == [0.5, 1.0]
    assert [c.request_id for c in gen.calls].count("dead") == 3


# -- the tiers ---------------------------------------------------------------------------------------

DESCRIPTION = "The person wears a dark jacket, light grey trousers and white shoes, and carries a black bag."


def _script(request: GenerationRequest) -> str | Exception:
    if request.expects == "qa_pairs":
        if "bad-qa" in request.request_id:
            return "I cannot answer that."
        return "Q1: What is on the top? A1: A dark jacket. Q2: What is on the bottom? A2: Light grey trousers."
    if "boom" in request.request_id:
        return RuntimeError("generation failed: CUDA out of memory")
    if "text-only" in request.request_id:  # models/backends/generators.py's answer to an image request
        return RuntimeError("unsupported: this generator does not take images")
    return DESCRIPTION


def _items(n: int, negatives: bool = True, n_generators: int = 2) -> list[TierImage]:
    img = np.zeros((8, 4, 3), np.uint8)
    return [TierImage(f"img-{i}", f"pool:x:{i}", "pedestrian", img, assign_generator(0, f"img-{i}", n_generators),
                      f"img-{(i + 1) % n}" if negatives else None, img if negatives else None) for i in range(n)]


def _captioner(*generators: ScriptedGenerator, **spec: object) -> TierCaptioner:
    return TierCaptioner(list(generators), load_prompt("gtr_tiers"), LargeFineSpec(**spec))


def test_three_tiers_account_for_every_image_and_record_lineage() -> None:
    g0, g1 = ScriptedGenerator(_script, "gen-a"), ScriptedGenerator(_script, "gen-b")
    cap = _captioner(g0, g1)
    items = _items(8)
    out = TierOutputs()
    base = cap.qa_tier(items, "base", out)
    inter = cap.qa_tier(items, "inter", out)
    gallery = GalleryBuilder(["clothing description"], 3, 40, 10)
    gallery.add("The person wears [clothing description] today.", "seed", 0)
    cap.advanced_tier(items, base, inter, gallery.gallery, out)
    assert len(out.captions) == 24 and not out.rejects
    empty = TierOutputs()  # every image has its T_base and T_inter, but there is no template to draw
    cap.advanced_tier(items, base, inter, GalleryBuilder([], 1, 5, 1).gallery, empty)
    assert [r["reason"] for r in empty.rejects] == ["no_template"] * len(items) and not empty.captions
    assert {c["tier"] for c in out.captions} == {"base", "inter", "adv"}
    for row in out.captions:
        item = next(i for i in items if i.image_id == row["image_id"])
        assert row["generator"] == ("gen-a", "gen-b")[item.generator_index]
        assert row["q_txt"] == pytest.approx(0.5)
        assert row["prompt"].startswith(load_prompt("gtr_tiers").identity)
        assert row["hard_negative_id"] == (None if row["tier"] == "base" else item.negative_id)
        assert (row["template_id"] is not None) == (row["tier"] == "adv")
    assert {i.generator_index for i in items} == {0, 1}  # both generators used
    assert len(out.qa) == 2 * 2 * 8  # two pairs per image in each of the Q&A tiers
    inter_calls = [c for c in g0.calls + g1.calls if c.request_id.endswith(":inter:qa")]
    assert all(len(c.messages[0].images) == 2 for c in inter_calls)  # target + hard negative
    adv_prompt = next(c for c in g0.calls + g1.calls if c.request_id.endswith(":adv:adv")).messages[0].content
    assert "[clothing description]" in adv_prompt and DESCRIPTION in adv_prompt


def test_failures_become_rejected_rows_with_reasons() -> None:
    cap = _captioner(ScriptedGenerator(_script), retries={"max_attempts": 2, "backoff_s": 0.0})
    items = _items(4, n_generators=1)
    items[0].image_id = "bad-qa-0"
    items[1].image_id = "boom-1"
    items[2].negative_id, items[2].negative_image = None, None
    items[3].image_id = "text-only-3"
    out = TierOutputs()
    base = cap.qa_tier(items, "base", out)
    inter = cap.qa_tier(items, "inter", out)
    cap.advanced_tier(items, base, inter, GalleryBuilder([], 1, 5, 1).gallery, out)
    reasons = {(r["input_id"], r["stage"]): r["reason"] for r in out.rejects}
    assert reasons[("bad-qa-0", "tier-base")] == "malformed_qa"
    assert reasons[("boom-1", "tier-base")] == "generation_failed"
    assert reasons[(items[2].image_id, "tier-inter")] == "no_hard_negative"
    assert reasons[(items[2].image_id, "tier-adv")] == "missing_tier_input"
    assert reasons[("text-only-3", "tier-base")] == reasons[("text-only-3", "tier-inter")] == "unsupported"
    assert len(out.captions) + len(out.rejects) == 3 * len(items)
    assert out.stats(len(items))["input_rows"] == 3 * 4  # texts requested: three tiers of four images
    calls = [c.request_id for c in cap.generators[0].calls]
    assert calls.count("boom-1:base:sum") == 2 and calls.count("bad-qa-0:base:qa") == 1  # retried once
    assert calls.count("text-only-3:base:qa") == 1  # unsupported is permanent: not asked again


# -- template gallery --------------------------------------------------------------------------------

SLOTS = load_prompt("gtr_template_gallery").extras["slots"]


@pytest.mark.parametrize(("text", "reason"), [
    ("The [person/man/woman] wears [clothing description] and [footwear description].", None),
    ("The person wears a red coat and blue jeans today.", "no_slot"),
    ("The [person/man/woman] wears [weapon description] and [clothing description].", "unknown_slot"),
    ("The [person/man/woman wears [clothing description] and shoes.", "malformed_template"),
    ("[clothing description]", "too_short"),
])
def test_template_validation(text: str, reason: str | None) -> None:
    bad = validate_template(text, SLOTS, min_words=6, max_words=60)
    assert (bad[0] if bad else None) == reason


def test_template_lines_and_duplicates() -> None:
    out = ("Here are templates:\n1. Wearing [clothing description], the [person/man/woman] walks.\n"
           "2) wearing [Clothing Description]; the [person/man/woman] walks!\n"
           "- A [person/man/woman] in [top description].")
    lines = split_template_lines(out)
    assert lines[1:] == ["Wearing [clothing description], the [person/man/woman] walks.",
                         "wearing [Clothing Description]; the [person/man/woman] walks!",
                         "A [person/man/woman] in [top description]."]
    assert template_key(lines[1]) == template_key(lines[2])
    builder = GalleryBuilder(SLOTS, 3, 60, 10)
    assert [builder.add(line, "extracted", 1) for line in lines] == [False, True, False, True]
    assert [r.reason for r in builder.gallery.rejected] == ["no_slot", "duplicate"]
    one = GalleryBuilder(SLOTS, 3, 60, max_templates=1)  # valid templates past max_templates: gallery_full
    assert [one.add(line, "extracted", 1) for line in (lines[1], lines[3])] == [True, False] and one.full
    assert [(r.reason, r.text) for r in one.gallery.rejected] == [("gallery_full", lines[3])]


def test_extract_and_expand_loop_builds_a_versioned_gallery() -> None:
    prompt = load_prompt("gtr_template_gallery")

    def script(request: GenerationRequest) -> str | Exception:
        if request.request_id.startswith("extract"):
            return "1. The [person/man/woman] is wearing [top description] over [bottom description].\n2. junk"
        if request.request_id == "expand-2":
            return "1. Seen from afar, the [person/man/woman] wears [clothing description] and [shoes description]."
        return RuntimeError("timeout after 1s")

    gen = ScriptedGenerator(script)
    kwargs = {"captions_per_request": 2, "rounds": 2, "max_templates": 40, "min_words": 6, "max_words": 60,
              "max_tokens": 64, "temperature": 0.7, "seed": 0}
    gallery = build_gallery(gen.generate, ["c1", "c2", "c3"], prompt, **kwargs)
    origins = [t.origin for t in gallery.templates]
    seeds = len(prompt.extras["seeds"])
    assert origins == ["seed"] * seeds + ["extracted", "expanded"]
    assert sum(r.reason == "duplicate" for r in gallery.rejected) == 1  # the second extract call
    assert {r.reason for r in gallery.rejected} >= {"no_slot", "generation_failed"}
    extract_prompt = gen.calls[0].messages[0].content
    assert "1. c1" in extract_prompt and "[clothing description]" in extract_prompt
    again = build_gallery(ScriptedGenerator(script).generate, ["c1", "c2", "c3"], prompt, **kwargs)
    assert again.version == gallery.version and gallery.version.startswith("gallery-")
    fewer = build_gallery(ScriptedGenerator(lambda r: "nothing").generate, ["c1"], prompt, **kwargs)
    assert fewer.version != gallery.version
    assert gallery.choose(5) == gallery.choose(5)


def test_templates_the_captioner_cannot_fill_are_rejected_and_not_offered() -> None:
    measurable = ["person/man/woman", "top description", "bottom description", "motion description"]
    ok = "The [person/man/woman] in [top description] and [bottom description] is [motion description]."
    hair = "The [person/man/woman] has [hair description] and wears [top description] today."
    assert validate_template(ok, SLOTS, 6, 60, measurable) is None
    assert validate_template(hair, SLOTS, 6, 60, measurable)[0] == "unmeasurable_slot"
    assert validate_template(hair, SLOTS, 6, 60) is None  # no list: every slot of the vocabulary

    asked: list[str] = []

    def generate(requests):
        asked.extend(r.messages[0].content for r in requests)
        return [GenerationResult(r.request_id, f"1. {hair}\n2. {ok}", [], "scripted") for r in requests]

    gallery = build_gallery(generate, ["A person in a red top."], load_prompt("gtr_template_gallery"),
                            captions_per_request=1, rounds=0, max_templates=64, min_words=6, max_words=60,
                            max_tokens=64, temperature=0.0, seed=0, measurable_slots=measurable)
    assert all(set(t.slots) <= set(measurable) for t in gallery.templates)
    assert {r.reason for r in gallery.rejected if r.text == hair} == {"unmeasurable_slot"}
    assert "[motion description]" in asked[0] and "[hair description]" not in asked[0]


def test_a_loop_without_full_stops_is_repetitive() -> None:
    """SmolLM2 at the demo's advanced tier once wrote "The person is wearing a black top" thirteen
    times without a full stop: one sentence, so the repeated-sentence share could not see it."""
    loop = " ".join(["The person is wearing a black top"] * 5) + "."
    gate = gate_caption(loop, min_words=5, max_words=100, boilerplate=(), max_repeated_sentence_share=0.5)
    assert gate.reason == "repetitive" and "twice in one sentence" in gate.detail
    fine = ("The person in Target-Image wears a black top, unlike the black top of the person in "
            "Compare-Image. The person is walking to the left.")
    assert gate_caption(fine, min_words=5, max_words=100, boilerplate=(),
                        max_repeated_sentence_share=0.5).reason is None
