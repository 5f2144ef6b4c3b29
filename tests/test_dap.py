"""DAP: keyword sampling, prompt filling (Table 11) and the query post-processing rules."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from domain_sets import DOMAINS, LAYOUT

from models.prompt_files import load_prompt
from rde.common import caption_stats
from rde.secmm.config import QueriesSpec
from rde.secmm.dap import dap_request, domain_queries, sample_keywords
from rde.secmm.dap_grammar import attested_uses, build_grammar
from rde.secmm.dap_postprocess import LineContext, output_examples, postprocess_queries, split_queries
from rde.secmm.dap_prompts import dap_prompt
from rde.secmm.sentence_checks import clean_caption

SPEC = QueriesSpec(min_words=5, max_words=15, per_request=7, keywords_per_pos=3, near_duplicate_cosine=0.9,
                   grammar_min_pair_count=1)  # the toy pools below say each pair once
DOMAIN = {"man", "woman", "person"}
BLOCKED = load_prompt("query_safety").extras["blocked"]


class BagOfWords:
    """A tiny deterministic text encoder: normalised word-count vectors."""

    dim = 64
    model_id = "bow"

    def encode(self, texts):
        out = np.zeros((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().replace(".", "").split():
                out[i, hash(w) % self.dim] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def test_split_queries_strips_bullets_numbers_and_quotes() -> None:
    text = '1. A man walks.\n- "A woman runs."\n\n  • A person waits  \n2) Another man sits.'
    assert split_queries(text) == ["A man walks.", "A woman runs.", "A person waits", "Another man sits."]


def test_postprocess_rules_in_order() -> None:
    cands = [
        ("A man in a red jacket walks past the gate.", "r0"),
        ("A man in a red jacket walks past the gate!", "r0"),  # same words → duplicate
        ("a man in a red jacket walks past a gate", "r1"),  # near duplicate by embedding
        ("Man walks.", "r1"),
        ("A woman " + "very " * 15 + "tall.", "r1"),
        ("Here is a man walking with a large dog today.", "r2"),
        ("What is the man in the blue coat doing now?", "r2"),
        ("I am going to find a man in a blue coat.", "r2"),
        ("A man man man man man man man man walks.", "r2"),
        ("A red car parked near the gate of the building.", "r3"),
        ("A man with a gun running across the parking lot.", "r3"),
        ("A woman carrying a white bag crosses the street slowly.", "r3"),
        ("", "r3"),
    ]
    verdicts = postprocess_queries(cands, DOMAIN, SPEC, BLOCKED, BagOfWords())
    assert [v.reason for v in verdicts] == [None, "duplicate", "near_duplicate", "too_short", "too_long",
                                            "not_a_query", "not_a_query", "not_a_query", "degenerate",
                                            "off_domain", "unsafe", None, "empty"]
    assert verdicts[2].detail.startswith("cosine")


class FixedCosine:
    """A text encoder whose every pair of distinct texts has cosine ``c`` (MiniLM's saturation on
    short templated queries: the demo's pairs below measured 0.92–0.99)."""

    def __init__(self, c: float) -> None:
        self.c = c

    def encode(self, texts: list[str]) -> np.ndarray:
        base = np.sqrt(self.c)
        out = np.zeros((len(texts), 1 + len(texts)), np.float32)
        out[:, 0] = base
        out[np.arange(len(texts)), 1 + np.arange(len(texts))] = np.sqrt(1 - self.c)
        return out


def test_near_duplicates_must_state_the_same_attributes() -> None:
    """At cosine 0.95 a query that states other colours (or another garment) is a new query; one
    that says the same thing in another order is a near duplicate (the demo's rejects)."""
    cands = [("A person wearing a black top and black bottoms.", "r0"),
             ("A person wearing black bottoms and a black top.", "r0"),  # same values, other order
             ("A person wearing black bottoms and a red top.", "r0"),  # 0.924 in the demo: another query
             ("A person wearing a black top.", "r1"),  # states no bottoms
             ("A car that is black.", "r1"), ("A vehicle that is black.", "r1"), ("A car that is gray.", "r1")]
    verdicts = postprocess_queries(cands, DOMAIN | {"person", "car", "vehicle"}, SPEC, BLOCKED, FixedCosine(0.95),
                                   context=LineContext(layout=LAYOUT))
    assert [v.reason for v in verdicts] == [None, "near_duplicate", None, None, None, None, None]
    assert "'A person wearing a black top and black bottoms.'" in verdicts[1].detail
    off = SPEC.model_copy(update={"near_duplicate_attributes": False})  # cosine alone, as before
    assert [v.reason for v in postprocess_queries(cands, DOMAIN | {"person", "car", "vehicle"}, off, BLOCKED,
                                                  FixedCosine(0.95), context=LineContext(layout=LAYOUT))][1:] == \
        ["near_duplicate"] * 6


def test_accepted_before_counts_for_duplicates() -> None:
    v = postprocess_queries([("A man in a red jacket walks past the gate.", "r9")], DOMAIN, SPEC, BLOCKED, None,
                            accepted_before=["a man in a red jacket walks past the gate"])
    assert v[0].reason == "duplicate"


def test_keywords_follow_the_statistics_and_fill_the_table11_prompt() -> None:
    stats = {"noun": Counter({"jacket": 50, "bag": 30, "umbrella": 1, "hat": 1}), "verb": Counter({"walk": 5}),
             "adj": Counter({"red": 9, "black": 8})}
    rng = np.random.default_rng(0)
    picks = Counter(w for _ in range(300) for w in sample_keywords(stats["noun"], 1, rng))
    assert picks["jacket"] > picks["bag"] > picks["umbrella"]
    keywords = {"noun": ["jacket", "bag"], "verb": ["walk"], "adj": ["red", "black"]}
    req = dap_request(load_prompt("dap_pedestrian"), keywords, SPEC, "q0", seed=3)
    system, user = req.messages
    assert "[Template Structure]" in system.content and "Safety Guardrails" in system.content
    assert "generate 7 pedestrian-related descriptions" in user.content
    assert "Verbs: walk" in user.content and req.seed == 3 and req.temperature == SPEC.temperature


def test_generation_failures_map_to_reason_codes() -> None:
    from rde.common.generation_retries import error_reason as generation_reason

    assert generation_reason("ungrounded: every sentence ...") == "ungrounded"
    assert generation_reason("refused: content_filter") == "refused"
    assert generation_reason("timeout after 60s (gave up after 4 attempts)") == "timeout"
    assert generation_reason("generation failed: RuntimeError: x") == "generation_failed"
    assert generation_reason(None) == "generation_failed"


# --- distribution checks: echoes, vocabulary, keywords ---------------------------------------------

PED = dap_prompt(DOMAINS["pedestrian"])
VEH = dap_prompt(DOMAINS["vehicle"])
# A small surveillance caption pool (what the grounded captioner keeps).
POOL = ["The person is wearing a black top and blue bottoms.", "The person is carrying a backpack.",
        "The person is wearing a gray top and black bottoms.", "The person is wearing a white top.",
        "The person is carrying a handbag.", "The person is wearing a blue top and gray bottoms.",
        "The person is wearing a black top and carrying a backpack."]
VOCAB = caption_stats.vocabulary(POOL) | set(PED.extras["vocabulary_allowed"])
PED_WORDS = set(PED.extras["domain_words"])


def test_output_examples_come_from_the_prompt_file() -> None:
    assert output_examples(PED)[0] == "A little boy sitting alone on a motorcycle."
    assert "A man with a racket on a tennis court." in output_examples(PED)
    assert output_examples(VEH) == ["A white van parked next to a brick wall.", "A red car driving down a wet street "
                                    "at night.", "A city bus stopped at a crowded bus stop."]


@pytest.mark.parametrize(("line", "example"), [
    ("A man with a racket on a tennis court.", "A man with a racket on a tennis court."),  # verbatim
    ("a man rides a motorcycle down an empty street next to houses", "A man rides a motorcycle"),  # normalised
    ("A little boy sat alone on a motorcycle.", "A little boy sitting alone"),  # one word changed
    ("A man in a pink jacket and printed pants.", "A woman in a pink jacket"),  # one word changed
    ("A red car driving down a crowded bus stop.", "A red car driving down a wet"),  # copies a run of words
    ("A gray car at a crowded bus stop.", "A city bus stopped"),  # copies "a crowded bus stop"
])
def test_echoes_of_the_output_examples_are_rejected(line: str, example: str) -> None:
    examples = output_examples(PED) + output_examples(VEH)
    [v] = postprocess_queries([(line, "r0")], PED_WORDS | set(VEH.extras["domain_words"]), SPEC, BLOCKED,
                              BagOfWords(), context=LineContext(examples, BagOfWords().encode(examples)))
    assert v.reason == "echoes_example" and example in v.detail


def test_a_fresh_query_is_not_an_echo() -> None:
    examples = output_examples(PED)
    [v] = postprocess_queries([("A man in a black top carrying a backpack.", "r0")], PED_WORDS, SPEC, BLOCKED,
                              BagOfWords(), context=LineContext(examples, BagOfWords().encode(examples)))
    assert v.reason is None


def test_off_vocabulary_words_are_rejected_with_the_words() -> None:
    lines = [("A woman riding a horse near the gate.", "r0"), ("A man in a black top carrying a backpack.", "r0")]
    verdicts = postprocess_queries(lines, PED_WORDS, SPEC, BLOCKED, None, context=LineContext(vocabulary=VOCAB))
    assert verdicts[0].reason == "off_vocabulary"
    assert {"riding", "horse", "gate"} <= set(verdicts[0].detail.split(": ")[1].split(", "))
    assert verdicts[1].reason is None


def test_a_line_without_its_request_keywords_is_rejected_and_kept_lines_record_them() -> None:
    sampled = {"noun": ["backpack", "bottoms"], "verb": ["carry"], "adj": ["gray"]}
    lines = [("A man wearing a white top and black bottoms.", "r0"), ("A woman in a blue top and a white top.", "r0"),
             ("A person carrying a gray backpack.", "r0")]
    verdicts = postprocess_queries(lines, PED_WORDS, SPEC, BLOCKED, None,
                                   context=LineContext(vocabulary=VOCAB, keywords={"r0": sampled}))
    assert [v.reason for v in verdicts] == [None, "no_keyword", None]
    assert "backpack" in verdicts[1].detail
    assert verdicts[0].keywords == ["bottoms"]  # lemma "bottom" / form "bottoms" both match
    assert sorted(verdicts[2].keywords) == ["backpack", "carry", "gray"]


# --- caption pool: complete, grounded sentences -----------------------------------------------------

GENERIC = set(load_prompt("caption_pool").extras["generic_words"])
NEEDS_OBJECT = load_prompt("caption_pool").extras["needs_object"]


@pytest.mark.parametrize("caption", [
    "The person is wearing a black with a black The person is wearing a black The person.",  # restarts
    "The person is carrying a.",  # a determiner with nothing after it
    "a dark and dark grey face with a black and gray complexion.",  # no verb
    "The person is dressed in a black with a black The person.",  # the demo's: no 3-gram repeats
    "The person is dressed in a black with a bag.",  # "a black" and no noun after the colour
    "The person is wearing.",  # the demo's: "wear" (prompt file needs_object) with nothing worn
    "The person is wearing a black and black clothing.",  # the demo's: a colour coordinated with itself
    "The person is wearing a black top and dark-black.",  # the demo's: a colour joined to a noun
    "The person carries a black and a black, high-.",  # the demo's: colours without a noun, a cut word
])
def test_fragmentary_captions_are_dropped(caption: str) -> None:
    check = clean_caption(caption, {"black", "gray", "backpack", "bag", "clothing"}, GENERIC,
                          needs_object=NEEDS_OBJECT)
    assert check.kept == "" and check.sentences[0].reason == "fragment"


def test_a_sentence_said_again_in_one_caption_is_dropped() -> None:
    """The demo's pool had "The person is wearing a black top." six times in one caption."""
    check = clean_caption("The person is wearing a black top. The person is wearing a black top. "
                          "The person is dressed in black. the person is wearing a black top", {"black", "top"},
                          GENERIC, needs_object=NEEDS_OBJECT)
    assert check.kept == "The person is wearing a black top. The person is dressed in black."
    assert [v.reason for v in check.sentences] == [None, "repeated_sentence", None, "repeated_sentence"]


@pytest.mark.parametrize("caption", [
    "The person is wearing a black and white top.", "The person is wearing a dark blue top.",
    "The vehicle is a black car.", "The person is wearing a black top. The person is wearing black bottoms.",
    "The vehicle is black and gray.", "The person is dressed in black.", "The person is carrying a backpack.",
])
def test_complete_colour_sentences_are_kept(caption: str) -> None:
    assert clean_caption(caption, {"black", "white", "blue", "gray", "car", "top", "bottoms", "backpack"}, GENERIC,
                         needs_object=NEEDS_OBJECT).clean


def test_ungrounded_attribute_sentences_are_dropped_and_grounded_ones_kept() -> None:
    check = clean_caption("The person is wearing a black top and grey bottoms. Their eyes are auburn in color.",
                          {"black", "gray", "top", "bottoms"}, GENERIC)
    assert check.kept == "The person is wearing a black top and grey bottoms."  # grey = measured gray
    [dropped] = check.dropped
    assert dropped.reason == "ungrounded_attribute" and "eyes" in dropped.detail and "auburn" in dropped.detail
    assert not check.clean and clean_caption(check.kept, {"black", "gray"}, GENERIC).clean


def test_a_caption_with_nothing_left_is_rendered_from_the_measured_values() -> None:
    from rde.secmm.sentence_checks import facts_caption

    prompt = load_prompt("caption_pool")
    templates = {d.name: d.captions.from_facts for d in DOMAINS}
    phrases, derived = prompt.extras["phrases"], prompt.extras["derived"]
    values = {"top": ["red", "black"], "bottom": ["blue"], "carried": [], "clothing": [], "motion": ["walking"],
              "direction": ["left"], "distance": ["far"]}
    said = {facts_caption(values, templates["pedestrian"], phrases, derived, f"img{i}") for i in range(12)}
    # one wording per image id, each stating every measured value, the distance as its own sentence
    assert said == {
        "A person wearing a red and black top and blue bottoms is walking to the left. The person is far from the "
        "camera.",
        "A pedestrian wearing a red and black top and blue bottoms is walking to the left. The person is far from "
        "the camera.",
        "A person in a red and black top and blue bottoms is heading to the left. The person is far from the camera."}
    assert facts_caption(values, templates["pedestrian"], phrases, derived, "img3") == \
        facts_caption(values, templates["pedestrian"], phrases, derived, "img3")  # stable per image
    still = {facts_caption({"top": ["red"], "motion": ["standing"]}, templates["pedestrian"], phrases, derived,
                           f"img{i}") for i in range(12)}  # no direction: no "heading" wording
    assert still == {"A person wearing a red top is standing.", "A pedestrian wearing a red top is standing."}
    untracked = {facts_caption({"top": ["red"]}, templates["pedestrian"], phrases, derived, f"img{i}")
                 for i in range(12)}
    assert untracked == {"A person wearing a red top.", "A pedestrian wearing a red top."}
    for text in said | still | untracked:  # every wording a complete, grounded sentence
        assert clean_caption(text, {"red", "black", "blue", "walking", "standing", "heading", "left", "far",
                                    "camera"}, GENERIC).clean, text
    assert facts_caption({"vehicle_type": ["truck"], "vehicle_colour": ["white"]},
                         templates["vehicle"], phrases) == "The vehicle is a white truck."
    assert facts_caption({"vehicle_type": ["truck"], "vehicle_colour": ["white"], "motion": ["parked"]},
                         templates["vehicle"], phrases) == "A white truck is parked."
    # a type the classifier contradicted is not measured: the colours alone, one sentence
    assert facts_caption({"vehicle_type": [], "vehicle_colour": ["black", "gray"]},
                         templates["vehicle"]) == "The vehicle is black and gray."
    assert facts_caption({"vehicle_colour": ["orange"], "motion": ["moving"], "direction": ["toward"]},
                         templates["vehicle"], phrases) == "An orange vehicle is moving toward the camera."


def test_predicative_colours_are_attested_on_their_subject() -> None:
    """"The vehicle is black and gray." attests both colours on "vehicle" (the conjunct too), so a
    vehicle of unclear type still gives DAP "A vehicle that is black and gray"."""
    uses = caption_stats.noun_uses(["The vehicle is black and gray.", "The vehicle is a white car."])
    assert uses["vehicle"].adjectives == {"black": 1, "gray": 1} and uses["vehicle"].subject == 2
    assert uses["car"].adjectives == {"white": 1}


# --- grammar-constrained generation --------------------------------------------------------------------

def test_grammar_offers_only_pool_phrases_for_the_sampled_keywords() -> None:
    uses = caption_stats.noun_uses(POOL)
    grammar = build_grammar(PED, {"noun": ["backpack", "top"], "verb": [], "adj": ["blue"]}, uses, PED_WORDS, SPEC)
    assert grammar is not None and grammar.count("line") >= SPEC.per_request
    assert '"carrying a backpack"' in grammar and '"wearing a blue top"' in grammar
    assert "handbag" not in grammar  # not sampled
    assert build_grammar(PED, {"noun": ["handbag"], "verb": [], "adj": []}, uses, PED_WORDS, SPEC) is None  # used once
    assert '"person"' in grammar and '"man"' not in grammar  # the pool's subject, not an unmeasured gender


def test_grammar_complements_are_only_combinations_one_pool_caption_states() -> None:
    """"white bottoms and a red top": each pair occurs in the pool, but on no single person. A line
    about a black top may add only what a caption with a black top also says (blue bottoms)."""
    pool = ["The person is wearing a black top and blue bottoms.", "The person is wearing a red top and gray bottoms.",
            "The person is wearing a white top and white bottoms.", "The person is wearing a red top.",
            "The person is wearing a black top.", "The person is wearing white bottoms."]
    uses = caption_stats.noun_uses(pool)
    together = uses["top"].together
    assert together[("black", "bottom", "blue")] == 1 and ("black", "bottom", "white") not in together
    assert uses["bottom"].adjectives == {"gray": 1, "blue": 1, "white": 2}  # not "top" (a mis-parse)
    sampled = {"noun": ["top", "bottom"], "verb": [], "adj": ["black", "red", "white"]}
    grammar = build_grammar(PED, sampled, uses, PED_WORDS, SPEC)
    assert grammar is not None
    rules = {r.split(" ::= ")[0]: r for r in grammar.splitlines()}
    black_line = next(r for r in rules.values() if '"wearing a black top"' in r)
    assert '"blue bottoms"' in black_line
    assert '"white bottoms"' not in black_line and '"gray bottoms"' not in black_line
    red_line = next(r for r in rules.values() if '"wearing a red top"' in r)
    assert '"gray bottoms"' in red_line and '"blue bottoms"' not in red_line and '"white bottoms"' not in red_line


def test_grammar_leaves_out_pairs_too_few_pool_captions_state() -> None:
    """A colour said of a garment by fewer than ``grammar_min_pair_count`` captions (a measurement
    slip on the demo: "red bottoms" from a red jacket's hem) offers no phrase, alone or as complement."""
    pool = ["The person is wearing a black top and blue bottoms."] * 3 + ["The person is wearing a black top and "
                                                                         "red bottoms."]
    uses = caption_stats.noun_uses(pool)
    spec = SPEC.model_copy(update={"grammar_min_pair_count": 2})
    kept = attested_uses(uses, 2)
    assert kept["bottom"].adjectives == {"blue": 3} and kept["top"].together == {("black", "bottom", "blue"): 3}
    grammar = build_grammar(PED, {"noun": ["top", "bottom"], "verb": [], "adj": ["red", "blue", "black"]}, uses,
                            PED_WORDS, spec)
    assert grammar is not None and '"blue bottoms"' in grammar and "red" not in grammar
    assert "red" in build_grammar(PED, {"noun": ["top", "bottom"], "verb": [], "adj": ["red", "blue", "black"]},
                                  uses, PED_WORDS, SPEC)  # with a threshold of 1 the slip is offered


def test_a_combination_needs_as_many_captions_as_a_single_pair() -> None:
    """Gray bottoms (4 captions) and a black top (4) are each attested, but one caption puts them
    together: with a threshold of 3 the black-top line offers blue bottoms only (the demo asked for
    "a black top and gray bottoms", which nobody in its pool wears)."""
    pool = (["The person is wearing a black top and blue bottoms."] * 3
            + ["The person is wearing a red top and gray bottoms."] * 3
            + ["The person is wearing a black top and gray bottoms."])
    uses = caption_stats.noun_uses(pool)
    kept = attested_uses(uses, 3)
    assert kept["bottom"].adjectives == {"blue": 3, "gray": 4} and kept["top"].adjectives == {"black": 4, "red": 3}
    assert ("black", "bottom", "gray") not in kept["top"].together
    spec = SPEC.model_copy(update={"grammar_min_pair_count": 3})
    grammar = build_grammar(PED, {"noun": ["top", "bottom"], "verb": [], "adj": ["black", "gray"]}, uses,
                            PED_WORDS, spec)
    black_line = next(r for r in grammar.splitlines() if '"wearing a black top"' in r)
    assert '"blue bottoms"' in black_line and '"gray bottoms"' not in black_line


def test_vehicle_grammar_offers_only_colours_the_pool_says_of_that_vehicle() -> None:
    """Buses are said gray, one car black and one truck white: "A truck that is gray" is no
    pool phrase (v2 of the prompt offered any attested colour after any subject)."""
    pool = ["The vehicle is a gray bus.", "The vehicle is a black car.", "The vehicle is a white truck.",
            "The vehicle is black and gray."]
    uses = caption_stats.noun_uses(pool)
    words = set(VEH.extras["domain_words"])
    grammar = build_grammar(VEH, {"noun": ["truck"], "verb": [], "adj": ["gray", "black", "white"]}, uses, words, SPEC)
    assert grammar is not None
    described = next(r for r in grammar.splitlines() if r.startswith("described ::="))
    assert '"bus that is gray"' in described and '"truck that is white"' in described
    assert '"vehicle that is black and gray"' in described and '"vehicle that is gray and black"' in described
    assert "truck that is gray" not in described and "bus that is black" not in described
    assert "car that is gray" not in described and "car that is black" in described


@pytest.mark.slow
def test_constrained_smollm2_writes_only_lines_that_pass_the_checks() -> None:
    from models.backends.llama_cpp_generator import LlamaCppGenerator
    from models.specs import ModelSpec

    gen = LlamaCppGenerator(ModelSpec(backend="llama-cpp", model_id="bundled:SmolLM2-135M-Instruct"))
    uses = caption_stats.noun_uses(POOL)
    sampled = {"noun": ["top", "backpack", "bottoms"], "verb": ["carry"], "adj": ["black", "gray"]}
    grammar = build_grammar(PED, sampled, uses, PED_WORDS, SPEC)
    [res] = gen.generate([dap_request(PED, sampled, SPEC, "r0", seed=7, grammar=grammar)])
    lines = split_queries(res.text)
    assert res.ok and len(lines) == SPEC.per_request
    examples = output_examples(PED)
    verdicts = postprocess_queries([(t, "r0") for t in lines], PED_WORDS, SPEC, BLOCKED, None,
                                   context=LineContext(examples, None, VOCAB, {"r0": sampled}))
    content = [v for v in verdicts if v.reason not in {"duplicate", "near_duplicate"}]
    assert [v.reason for v in content] == [None] * len(content), [(v.text, v.reason, v.detail) for v in verdicts]
    assert all(v.keywords for v in content)
    # The grammar cycles three line rules over the seven lines, each opening with its own phrase (a
    # black top, a gray top, a backpack), so three lines differ whatever the model picks, and each rule
    # must keep one. Half the lines is no floor: the rules allow 5 distinct lines at most, and seed 7
    # writes 3 (the gray-top rule has a single phrase, so its second line is always a duplicate).
    openings = set(re.findall(r'^line\d+ ::= "A " subject " " \("([^"]+)"\)', grammar, re.MULTILINE))
    kept = [v.text for v in verdicts if v.reason is None]
    assert len(openings) == 3 and len(kept) >= len(openings), [(v.text, v.reason) for v in verdicts]
    assert {o for o in openings if any(t.startswith(f"A person {o}") for t in kept)} == openings, kept
    assert {v.text for v in verdicts if v.reason == "duplicate"} <= set(kept)  # repeats of kept lines only


# --- caption pool: one row per captioned image ------------------------------------------------------

POOL_FACTS = DOMAINS["pedestrian"].captions.from_facts


def _pool(text: str, error: str | None = None, values: dict | None = None):
    from models.backends.interfaces import GenerationResult
    from rde.secmm.caption_pool import pool_caption

    res = GenerationResult("img", "" if error else text, [], "cap", "stop", error)
    check = clean_caption(res.text, {"black", "blue", "top", "bottoms"}, GENERIC, needs_object=NEEDS_OBJECT)
    return pool_caption(res, check, values, POOL_FACTS, "pedestrian", "caption_pool@4",
                        load_prompt("caption_pool").extras)


def test_pool_caption_keeps_the_grounded_sentences_and_details_the_rest() -> None:
    got = _pool("The person is wearing a black top. Their eyes are auburn.", values={"top": ["black"]})
    assert got.caption["text"] == "The person is wearing a black top." and got.caption["generator"] == "cap"
    assert [(r["stage"], r["reason"]) for r in got.rejects] == [("caption-pool-sentence", "ungrounded_attribute")]


def test_a_wholly_ungrounded_caption_is_said_from_the_facts() -> None:
    """The grounded captioner refuses a text whose every sentence states something unmeasured; the
    image still has measured facts, so its caption is rendered from them (the demo lost 32 of 154
    pool images to this before), and the refusal stays as a detail row."""
    values = {"top": ["red"], "bottom": ["blue"], "carried": [], "clothing": []}
    got = _pool("", error="ungrounded: every sentence stated something not measured ('a man': ['man'])",
                values=values)
    # the wording the image id "img" draws (test_a_caption_with_nothing_left_is_rendered_...: all three)
    assert got.caption["text"] == "A person wearing a red top and blue bottoms."
    assert got.caption["generator"] == "cap+facts" and got.rendered and got.caption["q_txt"] is None
    assert [(r["stage"], r["reason"]) for r in got.rejects] == [("caption-pool-sentence", "ungrounded_attribute")]


def test_a_failed_generation_is_the_images_reject_row() -> None:
    got = _pool("", error="timeout after 30 s", values={"top": ["red"]})
    assert got.caption is None and [(r["stage"], r["reason"]) for r in got.rejects] == [("caption-pool", "timeout")]
    nothing = _pool("", error="ungrounded: every sentence ...", values=None)  # no facts to say
    assert nothing.caption is None and nothing.rejects[0]["reason"] == "ungrounded"


# --- DAP rounds for one domain ----------------------------------------------------------------------

def test_domain_queries_fills_the_quota_and_accounts_for_every_line() -> None:
    """Three rounds of a scripted LLM: a failed request, then lines that are kept, duplicated, off
    the pool's vocabulary or over the quota of 3. Every returned line and the failed request is one
    row (input = 1 failed + 6 lines = 7), the keywords of each request are recorded, and no request
    is sent once the quota is full."""
    from scripted_generator import ScriptedGenerator

    pool = ["The person is wearing a black top and blue bottoms.", "The person is wearing a red top.",
            "The person is carrying a backpack."]
    stats = caption_stats.pos_frequencies(pool)
    answers = iter([RuntimeError("timeout after 30 s"),
                    "A person wearing a black top.\nA person wearing a black top.\nA person riding a horse today.",
                    "A person wearing a red top.\nA person carrying a backpack.\nA person wearing blue bottoms.",
                    "A person wearing a red top and blue bottoms."])
    gen = ScriptedGenerator(lambda request: next(answers))
    spec = SPEC.model_copy(update={"per_domain": 3, "max_rounds": 5, "keyword_check": False,
                                   "near_duplicate_cosine": 0.999})
    made = domain_queries("pedestrian", PED, stats, pool, gen, BagOfWords(), spec, BLOCKED, LAYOUT)
    assert [q["text"] for q in made.queries] == ["A person wearing a black top.", "A person wearing a red top.",
                                                 "A person carrying a backpack."]
    assert [q["query_id"] for q in made.queries] == ["pedestrian-q0001", "pedestrian-q0002", "pedestrian-q0003"]
    assert [(r["reason"], r["text"]) for r in made.rejects] == [
        ("generation_failed", None), ("duplicate", "A person wearing a black top."),
        ("off_vocabulary", "A person riding a horse today."), ("over_target", "A person wearing blue bottoms.")]
    assert made.lines_in == 7 == len(made.queries) + len(made.rejects)
    assert len(gen.calls) == 3 and [r["request"] for r in made.requests] == [f"pedestrian-r00{i}" for i in range(3)]
    assert all(set(r) >= {"noun", "adj", "verb", "grammar"} for r in made.requests)


def test_rounds_generated_ahead_give_the_same_queries_and_record_only_the_rounds_read() -> None:
    """A generator that answers three requests at once gets DAP's rounds three at a time; the
    queries, rejects, recorded requests and each round's request (keywords, grammar, seed) equal
    one-at-a-time generation's, and the rounds generated past the quota are not recorded."""
    from scripted_generator import ScriptedGenerator

    pool = ["The person is wearing a black top and blue bottoms.", "The person is wearing a red top.",
            "The person is carrying a backpack."]
    stats = caption_stats.pos_frequencies(pool)
    by_round = {0: "A person wearing a black top.", 1: RuntimeError("timeout after 30 s"),
                2: "A person wearing a black top.\nA person riding a horse today.",
                3: "A person wearing a red top.\nA person carrying a backpack."}
    spec = SPEC.model_copy(update={"per_domain": 3, "max_rounds": 9, "keyword_check": False,
                                   "near_duplicate_cosine": 0.999})

    def run(parallel: int):
        gen = ScriptedGenerator(lambda r: by_round.get(int(r.request_id.rsplit("r", 1)[1]), "A person walks."))
        gen.parallel_requests = parallel
        return gen, domain_queries("pedestrian", PED, stats, pool, gen, BagOfWords(), spec, BLOCKED, LAYOUT)

    one_gen, one = run(1)
    many_gen, many = run(3)
    assert [q["text"] for q in one.queries] == ["A person wearing a black top.", "A person wearing a red top.",
                                                "A person carrying a backpack."]
    assert (many.queries, many.rejects, many.requests, many.lines_in) == (one.queries, one.rejects, one.requests,
                                                                          one.lines_in)
    assert [r["request"] for r in many.requests] == [f"pedestrian-r00{i}" for i in range(4)]
    assert len(one_gen.calls) == 4 and len(many_gen.calls) == 6  # rounds 4 and 5 generated, never read
    assert [(c.request_id, c.messages, c.seed, c.grammar) for c in many_gen.calls[:4]] == \
        [(c.request_id, c.messages, c.seed, c.grammar) for c in one_gen.calls]


# --- actions in the grammar --------------------------------------------------------------------------

ACTION_POOL = ["A person wearing a black top is walking to the left.",
               "A person wearing a black top is walking to the left.",
               "A person in a black top is heading to the left.",
               "A person wearing a black top is standing.",
               "A person wearing a red top is walking toward the camera."]


def test_a_slot_the_pool_sees_doing_something_gets_an_action_line() -> None:
    """"[person] + descriptor + action": the action must be one that pool captions state together
    with the line's descriptor (black top: walking to the left, standing; never the red top's
    "toward the camera"), and a sampled verb puts its action first."""
    uses = caption_stats.noun_uses(ACTION_POOL)
    spec = SPEC.model_copy(update={"grammar_min_count": 1})
    grammar = build_grammar(PED, {"noun": ["top"], "verb": ["stand"], "adj": ["black"]}, uses, PED_WORDS, spec)
    assert grammar is not None
    lines = [r for r in grammar.splitlines() if r.startswith("line")]
    assert lines and all('"walking to the left"' in r and '"standing"' in r for r in lines)
    assert all("toward the camera" not in r for r in lines)
    assert all(r.index('"standing"') < r.index('"walking to the left"') for r in lines)  # the sampled verb first
    # the descriptor's wording rotates through the frames the pool uses ("wearing", "in")
    assert any('"wearing a black top"' in r for r in lines) and any('"in a black top"' in r for r in lines)
    thin = attested_uses(uses, 2)  # said once: "in a black top", "standing", "heading to the left" drop out
    assert thin["top"].actions == {("black", "walking to the left"): 2}


def test_a_fixed_seed_dap_run_states_two_facets() -> None:
    """DAP over a pool that says colours and actions, with a generator that takes the grammar's
    first path: kept queries state appearance and an action (the demo: 28 of 30)."""
    from rde.common.text_diversity import diversity

    class FirstPath:
        """Writes the grammar's first path (each group's first alternative, optional groups left
        out): one line per line rule, as a grammar-bound model that always takes the first branch."""

        model_id = "first-path"

        @staticmethod
        def first(tokens: list[str], rules: dict[str, list[str]]) -> str:
            out, depth, skip_from = [], 0, None  # skip_from: the depth whose later alternatives are skipped
            for tok in tokens:
                if tok == "(":
                    depth += 1
                elif tok == ")":
                    depth -= 1
                    skip_from = None if skip_from is not None and depth < skip_from else skip_from
                elif tok == "|":
                    skip_from = depth if skip_from is None else skip_from
                elif skip_from is None:
                    if tok.startswith('"'):
                        out.append(tok[1:-1].replace("\\n", ""))
                    elif tok in rules:
                        out.append(FirstPath.first(rules[tok], rules))
            return "".join(out)

        def generate(self, requests):
            from models.backends.interfaces import GenerationResult

            out = []
            for r in requests:
                rules = {}
                for rule in (r.grammar or "").splitlines():
                    name, rhs = rule.split(" ::= ", 1)
                    rhs = re.sub(r'\(\s*" and "\s*\([^()]*\)\s*\)\?', "", rhs)  # optional complement: left out
                    rules[name] = re.findall(r'"(?:[^"\\]|\\.)*"|\(|\)|\||[\w]+', rhs)
                lines = [self.first(toks, rules) for name, toks in rules.items() if name.startswith("line")]
                out.append(GenerationResult(r.request_id, "\n".join(lines), [], self.model_id))
            return out

    stats = caption_stats.pos_frequencies(ACTION_POOL)
    spec = SPEC.model_copy(update={"grammar_min_count": 1, "per_domain": 3, "max_rounds": 4, "seed": 5,
                                   "constrained_decoding": True, "vocabulary_check": False})
    made = domain_queries("pedestrian", PED, stats, ACTION_POOL, FirstPath(), BagOfWords(), spec, BLOCKED,
                          LAYOUT)
    texts = [q["text"] for q in made.queries]
    assert texts, [r["detail"] for r in made.rejects]
    summary = diversity(texts, LAYOUT)
    assert summary["facet_appearance"] == 1.0 and summary["facet_action"] > 0, texts
    assert summary["two_or_more_facets"] > 0, texts
