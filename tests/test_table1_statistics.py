"""GTR+ Table 1 statistics (``rde.common.caption_stats.text_statistics``, which the LargeFine card
and ``corpus_statistics`` use) on three sentences counted by hand."""

from __future__ import annotations

import pytest

from rde.common.caption_stats import text_statistics
from rde.largefine.card import corpus_statistics

# Counted by hand (a word is alphabetic: the full stops are not words):
#   "A tall man wears a red coat."          7 words; adjectives tall, red (2);
#                                           noun chunks "A tall man", "a red coat" (2)
#   "The woman carries a black bag."        6 words; adjective black (1); noun chunks "The woman", "a black bag" (2)
#   "She walks quickly across the street."  6 words; no adjective (quickly is an adverb) (0);
#                                           noun chunks "She", "the street" (2)
# Sums: 19 words, 3 adjectives, 6 noun chunks over 3 texts → 19/3, 1 and 2 per text.
SENTENCES = ["A tall man wears a red coat.", "The woman carries a black bag.", "She walks quickly across the street."]


def _means(texts: int, words: int, adjectives: int, chunks: int) -> dict:
    """The Table 1 row of these hand-counted sums (tolerance 1e-12: integer counts divided once)."""
    return {"texts": texts, "words_per_text": pytest.approx(words / texts, abs=1e-12),
            "adjectives_per_text": pytest.approx(adjectives / texts, abs=1e-12),
            "noun_chunks_per_text": pytest.approx(chunks / texts, abs=1e-12)}


def test_text_statistics_by_hand() -> None:
    got = text_statistics(SENTENCES)
    assert got == _means(3, 19, 3, 6)  # 6.333 words, 1 adjective and 2 noun chunks per text
    # per tier and overall: the first two sentences (13 words, 3 adjectives, 4 chunks), the third alone (6, 0, 2)
    tiers = corpus_statistics({"base": SENTENCES[:2], "inter": SENTENCES[2:], "adv": []})
    assert set(tiers) == {"base", "inter", "all"}  # a tier without texts has no row
    assert tiers["base"] == _means(2, 13, 3, 4) and tiers["inter"] == _means(1, 6, 0, 2)
    assert tiers["all"] == got
