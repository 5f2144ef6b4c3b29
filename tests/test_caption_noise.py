"""Hallucination-style caption noise (rde/training/caption_noise.py): hand-checked swaps."""

from __future__ import annotations

import numpy as np

from rde.training.caption_noise import COLOUR_WORDS, corrupt_caption


def test_one_colour_is_replaced_by_another_and_the_article_fixed() -> None:
    text = "The person wears a black top and carries nothing."
    new, swaps = corrupt_caption(text, np.random.default_rng(0), max_swaps=1, kinds={"colour": ("black", "orange")})
    assert new == "The person wears an orange top and carries nothing."
    assert [(s.kind, s.old, s.new, s.start) for s in swaps] == [("colour", "black", "orange", 19)]


def test_a_carried_object_keeps_its_article_right() -> None:
    text = "A person is carrying an umbrella."
    new, swaps = corrupt_caption(text, np.random.default_rng(3), max_swaps=1,
                                 kinds={"carried": ("umbrella", "backpack")})
    assert new == "A person is carrying a backpack." and swaps[0].old == "umbrella"


def test_capitalisation_and_plural_garments_stay() -> None:
    """Candidates Blue, jeans, gray; the only colour not in the caption is red, so at most one
    colour changes; jeans → shorts keeps "are"."""
    text = "Blue jeans are worn with a gray shirt."
    allowed = {1: {"Red jeans are worn with a gray shirt.", "Blue shorts are worn with a gray shirt.",
                   "Blue jeans are worn with a red shirt."},
               2: {"Red shorts are worn with a gray shirt.", "Blue shorts are worn with a red shirt."}}
    seen = set()
    for seed in range(20):
        new, swaps = corrupt_caption(text, np.random.default_rng(seed), max_swaps=2,
                                     kinds={"colour": ("blue", "gray", "red"), "lower_garment": ("jeans", "shorts")})
        assert new in allowed[len(swaps)], new
        seen.add(new)
    assert len(seen) >= 4


def test_no_known_word_leaves_the_caption_unchanged() -> None:
    text = "The person walks along the pavement."
    assert corrupt_caption(text, np.random.default_rng(0)) == (text, [])


def test_demo_caption_gets_one_or_two_wrong_facts_and_stays_fluent() -> None:
    text = "The person's top is black and the person's bottoms are blue. The person is carrying a backpack."
    seen = set()
    for seed in range(30):
        new, swaps = corrupt_caption(text, np.random.default_rng(seed))
        assert 1 <= len(swaps) <= 2 and new != text
        assert new.count(" ") == text.count(" ")  # a word for a word
        for s in swaps:
            assert s.old.lower() != s.new and text[s.start:s.start + len(s.old)] == s.old
            if s.kind == "colour":
                assert s.new in COLOUR_WORDS and s.new not in {"black", "blue"}
        colours = [w.strip(".") for w in new.split() if w.strip(".") in COLOUR_WORDS]
        assert len(colours) == len(set(colours)) == 2  # no "black and black"
        assert " a umbrella" not in new and " an backpack" not in new and " an suitcase" not in new
        seen.add(len(swaps))
    assert seen == {1, 2}


def test_generic_words_and_modifiers_stay() -> None:
    text = "The person wears a dark top, light clothing and bottoms."
    assert corrupt_caption(text, np.random.default_rng(0)) == (text, [])
